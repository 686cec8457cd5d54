"""A Flax layer's computation and parameters adapted to the kernels: what the modules of
``jax_brgemm.nn`` and ``jax_brgemm.nnx`` and ``accelerate()`` (which runs stock Flax
modules) share, for linen and NNX layers alike.

Every function answers a ``Decision``: a configuration the kernels cannot take falls back
to the stock computation, and ``accelerate()`` reports the reason.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen.dtypes import canonicalize_dtype, promote_dtype
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from jax_brgemm import _validate as check
from jax_brgemm import precision as jb_precision

class Decision(NamedTuple):
    """Whether the kernels take a layer's call: ``value`` (the result on the kernels, or
    what they take) with ``reason == ""``, or ``value`` None and why the stock code runs it.
    A pair, so ``y, why = decision`` reads it too."""

    value: Any = None
    reason: str = ""

    @property
    def taken(self) -> bool:
        return not self.reason

    @classmethod
    def stock(cls, why: str) -> "Decision":
        return cls(None, why)


#: The LSTM's gates in the order the fused layer (and ``OptimizedLSTMCell``) computes them.
GATES = "ifgo"

#: The gate and cell functions the fused LSTM computes, sigmoid and tanh, under every name
#: Flax and JAX give them (one object each today; the sets outlive a re-export changing).
SIGMOIDS = frozenset({nn.sigmoid, nnx.sigmoid, jax.nn.sigmoid})
TANHS = frozenset({nn.tanh, nnx.tanh, jnp.tanh, getattr(jax.nn, "tanh", jnp.tanh)})


def sigmoid_tanh_gates(cell) -> bool:
    """A linen or NNX LSTM cell's ``gate_fn`` is sigmoid and its ``activation_fn`` tanh, as
    the fused layer computes them (by identity: a callable object need not be hashable)."""
    return (any(cell.gate_fn is f for f in SIGMOIDS)
            and any(cell.activation_fn is f for f in TANHS))


def per_dim(value, rank: int) -> tuple[int, ...]:
    """A conv stride or dilation (None: 1; an int: every dim) as one value per spatial dim."""
    value = 1 if value is None else value
    return (value,) * rank if isinstance(value, (int, np.integer)) else tuple(value)


_F32, _BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)


def custom_dot_general(layer) -> bool:
    """A Dense / Linear ``layer`` multiplies with something else than ``lax.dot_general``
    (linen's fields default to None, NNX's to ``lax.dot_general`` itself)."""
    if isinstance(layer, nnx.Module):
        return layer.dot_general is not lax.dot_general
    return layer.dot_general is not None or layer.dot_general_cls is not None


def custom_conv(layer) -> bool:
    """A Conv ``layer`` convolves with something else than ``lax.conv_general_dilated``."""
    if isinstance(layer, nnx.Module):
        return layer.conv_general_dilated is not lax.conv_general_dilated
    return layer.conv_general_dilated is not None or layer.conv_general_dilated_cls is not None


def out_features(layer) -> int:
    """A linen layer's ``features``, an NNX layer's ``out_features``."""
    return layer.out_features if isinstance(layer, nnx.Module) else layer.features


def precision_why(precision) -> str:
    """Why a layer's ``precision`` field asks for what the kernels do not compute (an
    algorithm outside ``jax_brgemm.precision.ACCURACY``), "" when they take it."""
    try:
        jb_precision.accuracy(precision, "")
    except ValueError:
        return f"precision {precision!r}"
    return ""


def computation_dtype(requested, *arrays):
    """``Decision(dtype)``: Flax's computation dtype (``requested``, or the promotion of the
    arrays' dtypes; None entries skipped) when it is one the kernels compute in."""
    try:
        dtype = np.dtype(canonicalize_dtype(*arrays, dtype=requested))
    except ValueError as e:  # the stock computation raises it again
        return Decision.stock(f"dtype ({e})")
    if dtype not in check.KERNEL_DTYPES:
        return Decision.stock(f"{dtype} computation")
    return Decision(dtype)


def kernel_operands(layer, inputs, kernel, bias):
    """``Decision((inputs, kernel, bias, dtype))``: a Dense / Linear or Conv layer's operands as
    the kernels take them, with the computation dtype, from the layer's ``dtype`` and
    ``promote_dtype`` (and, for NNX layers, ``preferred_element_type``) fields.

    With Flax's own ``promote_dtype`` (linen's or NNX's) the dtype is Flax's and only the
    inputs are cast to it: the kernel and bias go in as they are and are cast inside the
    custom call, so their gradients stay in the parameter dtype without a rounding to the
    computation dtype in between. A custom ``promote_dtype`` is called (an NNX layer's with
    the arrays as one tuple, as NNX does), and its arrays are taken when they share a dtype
    the kernels compute in. ``preferred_element_type=float32`` over a bfloat16 computation
    is float32 products of the bfloat16-rounded operands (exact), so it runs as a float32
    computation on them.
    """
    if layer.promote_dtype is promote_dtype or layer.promote_dtype is nnx_dtypes.promote_dtype:
        dtype, why = computation_dtype(layer.dtype, inputs, kernel, bias)
        if dtype is None:
            return Decision.stock(why)
        kernel, bias = (a if a is None or a.dtype in check.KERNEL_DTYPES else jnp.asarray(a, dtype)
                        for a in (kernel, bias))
        inputs = jnp.asarray(inputs, dtype)
    else:
        if isinstance(layer, nnx.Module):
            inputs, kernel, bias = layer.promote_dtype((inputs, kernel, bias), dtype=layer.dtype)
        else:
            inputs, kernel, bias = layer.promote_dtype(inputs, kernel, bias, dtype=layer.dtype)
        dtypes = {np.dtype(a.dtype) for a in (inputs, kernel, bias) if a is not None}
        if len(dtypes) != 1 or not dtypes <= set(check.KERNEL_DTYPES):
            return Decision.stock("custom promote_dtype to " + ", ".join(sorted(map(str, dtypes))))
        dtype = dtypes.pop()
    preferred = getattr(layer, "preferred_element_type", None)
    if preferred is not None and np.dtype(preferred) != dtype:
        if not (np.dtype(preferred) == _F32 and dtype == _BF16):
            return Decision.stock(f"preferred_element_type {np.dtype(preferred)} over a {dtype} computation")
        inputs, kernel, bias = (a if a is None else jnp.asarray(a, _BF16).astype(_F32)
                                for a in (inputs, kernel, bias))
        dtype = _F32
    return Decision((inputs, kernel, bias, dtype))


def lstm_params(cell):
    """``Decision((kernel_i (C, 4K), kernel_h (K, 4K), bias (4K,)))``: the fused layer's
    parameters from an LSTM cell's parameter tree.

    ``cell`` is what ``flax.linen.OptimizedLSTMCell`` and ``LSTMCell`` both create: per gate
    an input kernel ``i<gate>`` without bias and a recurrent kernel ``h<gate>`` with one;
    the fused layer takes each kind side by side in ``GATES`` order.
    """
    names = [f"{kind}{gate}" for kind in "ih" for gate in GATES]
    if (any(n not in cell or "kernel" not in cell[n] for n in names)
            or any("bias" not in cell[f"h{g}"] for g in GATES)
            or any("bias" in cell[f"i{g}"] for g in GATES)):
        return Decision.stock("parameters not created yet")
    kernel_i = jnp.concatenate([cell[f"i{g}"]["kernel"] for g in GATES], axis=-1)
    kernel_h = jnp.concatenate([cell[f"h{g}"]["kernel"] for g in GATES], axis=-1)
    bias = jnp.concatenate([cell[f"h{g}"]["bias"] for g in GATES], axis=-1)
    return Decision((kernel_i, kernel_h, bias))
