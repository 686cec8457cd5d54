"""The layer classes a model is built from, chosen once by ``impl``.

Models take their layer classes as fields (flax's style, ``dense=flax.linen.Dense``); the
public switch ``impl="brgemm" | "xla"`` names a set of them::

    LAYERS["brgemm"].dense is jax_brgemm.nn.Dense
    LAYERS["xla"].dense is flax.linen.Dense

Both sets create identical parameters. ``activated`` applies an activation after a layer:
fused into it when the layer class has an ``activation`` field (jax_brgemm's modules), as
a separate function after it otherwise (flax.linen's). Conv and LSTM models follow the same
pattern (a ``conv`` / ``lstm`` entry in ``Layers``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn

from jax_brgemm import nn as jbnn

#: The implementations a model can be built on.
IMPLS = ("brgemm", "xla")

#: The activations a model can apply after a layer: fused by jax_brgemm's layers,
#: the same stock function after flax.linen's.
ACTIVATIONS: dict[str, Callable[[Any], Any]] = jbnn.ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class Layers:
    """The layer classes of one implementation.

    Attributes:
      dense: a ``flax.linen.Dense``-compatible module class.
      conv: a ``flax.linen.Conv``-compatible module class.
    """

    dense: type
    conv: type = nn.Conv


LAYERS: dict[str, Layers] = {
    "brgemm": Layers(dense=jbnn.Dense, conv=jbnn.Conv),
    "xla": Layers(dense=nn.Dense, conv=nn.Conv),
}


def layers(impl: str, model: str = "model") -> Layers:
    """The layer classes ``impl`` names, or a ValueError naming ``model`` and ``IMPLS``."""
    if impl not in LAYERS:
        raise ValueError(f"{model} impl must be one of {IMPLS}, got {impl!r}")
    return LAYERS[impl]


def check_activation(activation: Optional[str], model: str = "model") -> None:
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"{model} activation must be one of {sorted(ACTIVATIONS)}, "
                         f"got {activation!r}")


def fuses_activation(layer_cls: type) -> bool:
    """Whether ``layer_cls`` takes an ``activation`` field (applies it itself)."""
    return dataclasses.is_dataclass(layer_cls) and any(
        f.name == "activation" for f in dataclasses.fields(layer_cls))


def activated(layer_cls: type, activation: Optional[str], **kwargs) -> Callable[[Any], Any]:
    """``layer_cls(**kwargs)`` followed by ``activation`` (a name of ``ACTIVATIONS``, or None)."""
    if activation is None:
        return layer_cls(**kwargs)
    if fuses_activation(layer_cls):
        return layer_cls(activation=activation, **kwargs)
    layer, fn = layer_cls(**kwargs), ACTIVATIONS[activation]
    return lambda x: fn(layer(x))
