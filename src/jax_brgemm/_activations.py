"""The fused activations in plain jnp: what the kernels compute, for the stock fallbacks and
models' XLA layers, and the derivatives the differentiable backward needs.

Names and codes come from C++ (``jb::kActivationNames``, through ``_native``); this module
only adds the math for each name.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from jax_brgemm._validate import ACTIVATIONS

#: name -> the stock function the kernels' fused activation matches (gelu: the tanh
#: approximation, as ``flax.linen.gelu`` / ``jax.nn.gelu``'s default).
FUNCTIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": partial(jax.nn.gelu, approximate=True),
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
}

NAMES: dict[int, str | None] = {code: name for name, code in ACTIVATIONS.items()}


def apply(name: str | None, y):
    """``y`` with the activation applied (None: unchanged)."""
    return y if name is None else FUNCTIONS[name](y)


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
        return jax.jvp(FUNCTIONS["gelu"], (s,), (jnp.ones_like(s),))[1]
    raise ValueError(f"no derivative for activation {name!r}")
