"""The fused activations: the package's one table of them, the math for each in plain jnp
(what the kernels compute, for the stock fallbacks and models' XLA layers), and the
derivatives the differentiable backward needs.

Names and codes come from C++ (``jb::kActivationNames``, through ``_native``); this module
only adds the stock function for each name, and fails at import if the two disagree.
"""

from __future__ import annotations

from functools import partial
from types import MappingProxyType
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from jax_brgemm._native import ACTIVATION_CODES

#: The activations the kernels fuse, by name, and the stock function each one matches (what
#: a stock layer followed by that function computes; gelu: the tanh approximation, as
#: ``flax.linen.gelu`` / ``jax.nn.gelu``'s default). Read-only: every module shares it.
ACTIVATIONS: Mapping[str, Callable[[jax.Array], jax.Array]] = MappingProxyType({
    "relu": jax.nn.relu,
    "gelu": partial(jax.nn.gelu, approximate=True),
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
})

if set(ACTIVATION_CODES) - {"none"} != set(ACTIVATIONS):  # a C++ activation without its math
    raise ImportError(f"jax_brgemm: the kernels fuse {sorted(ACTIVATION_CODES)}, the Python side "
                      f"knows {sorted(ACTIVATIONS)}: rebuild the extension from this source")


def code_of(name: str | None) -> int:
    """The kernels' code of an activation name (None: no activation). Validate first
    (``_validate.activation``): an unknown name is a KeyError here."""
    return ACTIVATION_CODES["none" if name is None else name]


def name_of(code: int) -> str | None:
    """The activation name of a kernels' code (None: no activation)."""
    found = next(n for n, c in ACTIVATION_CODES.items() if c == code)
    return None if found == "none" else found


def apply(name: str | None, y):
    """``y`` with the activation applied (None: unchanged)."""
    return y if name is None else ACTIVATIONS[name](y)


def derivative(name: str, saved):
    """``f'`` as a function of what the forward saved (y, or z for gelu), in float32.

    Written in jnp so that it is itself differentiable (``f''`` for grad of grad).
    """
    s = saved.astype(jnp.float32)
    if name == "relu":
        return (s > 0).astype(jnp.float32)
    if name == "sigmoid":
        return s * (1 - s)
    if name == "tanh":
        return 1 - s * s
    if name == "gelu":
        return jax.jvp(ACTIVATIONS["gelu"], (s,), (jnp.ones_like(s),))[1]
    raise ValueError(f"no derivative for activation {name!r}")
