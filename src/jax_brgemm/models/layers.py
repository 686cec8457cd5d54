"""The layer classes a model is built from, chosen once by ``impl``.

Models take their layer classes as fields (flax's style, ``dense=flax.linen.Dense``); the
public switch ``impl="brgemm" | "xla"`` names a set of them::

    LAYERS["brgemm"].dense is jax_brgemm.nn.Dense
    LAYERS["xla"].dense is flax.linen.Dense
    LAYERS["brgemm"].conv is jax_brgemm.nn.Conv
    LAYERS["brgemm"].lstm is jax_brgemm.nn.LSTM
    LAYERS["xla"].lstm is stock_lstm      # flax.linen.RNN(flax.linen.OptimizedLSTMCell)
    LAYERS["brgemm"].attention is jax_brgemm.nn.MultiHeadDotProductAttention
    LAYERS["xla"].attention is flax.linen.MultiHeadDotProductAttention

Both sets create identical parameters. ``activated`` applies an activation after a layer:
fused into it when the layer class has an ``activation`` field (jax_brgemm's modules), as
a separate function after it otherwise (flax.linen's). Conv, LSTM and Transformer models take
their layers the same way (the ``conv`` / ``lstm`` / ``attention`` entries of ``Layers``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn

from jax_brgemm import nn as jbnn
# ACTIVATIONS: the activations a model can apply after a layer (jax_brgemm.nn's table):
# fused by jax_brgemm's layers, the same stock function after flax.linen's.
from jax_brgemm.nn import ACTIVATIONS

#: The implementations a model can be built on.
IMPLS = ("brgemm", "xla")


@dataclasses.dataclass(frozen=True)
class Layers:
    """The layer classes of one implementation.

    Attributes:
      dense: a ``flax.linen.Dense``-compatible module class.
      conv: a ``flax.linen.Conv``-compatible module class.
      lstm: ``lstm(features, **fields)`` -> a module with the fields and the call of
        ``flax.linen.RNN(flax.linen.OptimizedLSTMCell(features))`` (``time_major``,
        ``return_carry``, ``reverse``, ``keep_order``, ``dtype``, ``param_dtype``, ``name``)
        and its parameters: ``jax_brgemm.nn.LSTM`` or ``stock_lstm``.
      attention: a ``flax.linen.MultiHeadDotProductAttention``-compatible module class.
    """

    dense: type
    conv: type = nn.Conv
    lstm: Optional[Callable[..., nn.Module]] = None
    attention: type = nn.MultiHeadDotProductAttention


_CELL_FIELDS = ("dtype", "param_dtype", "kernel_init", "recurrent_kernel_init", "bias_init",
                "carry_init")


def stock_lstm(features: int, **fields) -> nn.RNN:
    """``flax.linen.RNN(flax.linen.OptimizedLSTMCell(features))`` built from
    ``jax_brgemm.nn.LSTM``'s fields: the cell's (dtype, initializers) go to the cell, the
    rest (time_major, return_carry, reverse, keep_order, name) to the RNN."""
    cell = {k: fields.pop(k) for k in _CELL_FIELDS if k in fields}
    # parent=None: the RNN adopts the cell (as 'cell'), not the module building the model.
    return nn.RNN(nn.OptimizedLSTMCell(features, parent=None, **cell), **fields)


LAYERS: dict[str, Layers] = {
    "brgemm": Layers(dense=jbnn.Dense, conv=jbnn.Conv, lstm=jbnn.LSTM,
                     attention=jbnn.MultiHeadDotProductAttention),
    "xla": Layers(dense=nn.Dense, conv=nn.Conv, lstm=stock_lstm,
                  attention=nn.MultiHeadDotProductAttention),
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
