"""What the NNX modules share on the way to the kernels: the computation dtype an NNX layer
would use, and each layer's call on ``jb.dense`` / ``jb.conv2d`` / ``jb.lstm``.

Every function returns ``(result, "")`` when the kernels compute what the stock NNX layer
computes, or ``(None, why not)``; the caller then runs the stock code.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.linear import canonicalize_padding
from jax import lax

from jax_brgemm import _validate as check
from jax_brgemm.ops.conv import conv2d
from jax_brgemm.ops.dense import dense

_F32 = np.dtype(jnp.float32)
_BF16 = np.dtype(jnp.bfloat16)


def negotiate(promote: Callable, dtype: Any, preferred_element_type: Any, *arrays):
    """``(arrays, compute dtype, "")`` for the kernels, or ``(None, None, why not)``.

    ``promote`` is the layer's ``promote_dtype``: NNX's own decides the dtype as the stock
    layer does, but the parameters (``arrays[1:]``) go in uncast, so the custom call casts
    them and their gradients stay in the parameter dtype without a rounding in between.
    ``preferred_element_type=float32`` over a bfloat16 computation is float32 products of
    the bfloat16-rounded operands (exact), so it runs as a float32 computation on them.
    """
    if promote is nnx_dtypes.promote_dtype:
        try:
            compute = np.dtype(nnx_dtypes.canonicalize_dtype(*arrays, dtype=dtype))
        except ValueError as e:  # the stock computation raises it again
            return None, None, f"dtype ({e})"
        if compute not in check.KERNEL_DTYPES:
            return None, None, f"{compute} computation"
        first, *params = arrays
        params = [a if a is None or np.dtype(a.dtype) in check.KERNEL_DTYPES
                  else jnp.asarray(a, compute) for a in params]
        arrays = (jnp.asarray(first, compute), *params)
    else:
        arrays = promote(tuple(arrays), dtype=dtype)
        found = {np.dtype(a.dtype) for a in arrays if a is not None}
        if len(found) != 1 or not found <= set(check.KERNEL_DTYPES):
            return None, None, "custom promote_dtype to " + ", ".join(sorted(map(str, found)))
        compute = found.pop()
    if preferred_element_type is not None:
        preferred = np.dtype(preferred_element_type)
        if preferred == _F32 and compute == _BF16:
            # bf16 products are exact in float32: round the operands, multiply in float32
            arrays = tuple(a if a is None else jnp.asarray(a, _BF16).astype(_F32) for a in arrays)
            compute = _F32
        elif preferred != compute:
            return None, None, f"preferred_element_type {preferred} over a {compute} computation"
    return arrays, compute, ""


def linear(layer, inputs, activation):
    """``flax.nnx.Linear``'s call (``layer`` has its fields) on the FC kernels."""
    if layer.dot_general is not lax.dot_general:
        return None, "custom dot_general"
    kernel = layer.kernel[...]
    bias = layer.bias[...] if layer.bias is not None else None
    arrays, compute, why = negotiate(layer.promote_dtype, layer.dtype,
                                     layer.preferred_element_type, inputs, kernel, bias)
    if arrays is None:
        return None, why
    x, kernel, bias = arrays
    return dense(x, kernel, bias, activation=activation, dtype=compute), ""


def _broadcast(value, rank):
    value = 1 if value is None else value
    return (value,) * rank if isinstance(value, int) else tuple(value)


def conv(layer, inputs, activation):
    """``flax.nnx.Conv``'s call (``layer`` has its fields) on the convolution kernels: 1-D
    and 2-D, every padding form, strides, masks; no dilation or feature groups."""
    kernel_size = tuple(layer.kernel_size)
    rank = len(kernel_size)
    if rank not in (1, 2):
        return None, f"{rank}-D convolution"
    if layer.feature_group_count != 1:
        return None, "feature groups"
    if layer.conv_general_dilated is not lax.conv_general_dilated:
        return None, "custom conv_general_dilated"
    strides, input_dilation, kernel_dilation = (
        _broadcast(v, rank) for v in (layer.strides, layer.input_dilation, layer.kernel_dilation))
    if any(d != 1 for d in input_dilation):
        return None, "input dilation"
    if any(d != 1 for d in kernel_dilation):
        return None, "kernel dilation"
    batch_dims = inputs.ndim - (rank + 1)
    batch_shape = inputs.shape[:batch_dims]
    if batch_dims != 1:
        inputs = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
    padding = canonicalize_padding(layer.padding, rank)
    if padding in ('CIRCULAR', 'REFLECT'):
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in kernel_size] + [(0, 0)]
        inputs = jnp.pad(inputs, pads, mode={'CIRCULAR': 'wrap', 'REFLECT': 'reflect'}[padding])
        padding = 'VALID'
    elif padding == 'CAUSAL':
        if rank != 1:
            return None, "causal padding of a 2-D convolution"
        inputs = jnp.pad(inputs, [(0, 0), (kernel_size[0] - 1, 0), (0, 0)])
        padding = 'VALID'
    if isinstance(padding, str):
        if padding.upper() not in ('SAME', 'VALID', 'SAME_LOWER'):
            return None, f"padding {padding!r}"
    else:
        padding = [tuple(p) for p in padding]
        if any(v < 0 for p in padding for v in p):
            # a negative pad crops: slice it off, so the kernels see pads >= 0
            spatial = inputs.shape[1:1 + rank]
            if any(n + min(lo, 0) + min(hi, 0) < 1 for n, (lo, hi) in zip(spatial, padding)):
                return None, "padding crops the whole input"
            inputs = inputs[(slice(None),) + tuple(slice(-min(lo, 0), n + min(hi, 0))
                                                   for n, (lo, hi) in zip(spatial, padding))]
            padding = [(max(lo, 0), max(hi, 0)) for lo, hi in padding]
    kernel = layer.kernel[...]
    if layer.mask is not None:
        kernel = kernel * layer.mask
    bias = layer.bias[...] if layer.bias is not None else None
    arrays, compute, why = negotiate(layer.promote_dtype, layer.dtype,
                                     layer.preferred_element_type, inputs, kernel, bias)
    if arrays is None:
        return None, why
    x, kernel, bias = arrays
    if rank == 1:  # a 1-D convolution is a 2-D one over a single row
        if not isinstance(padding, str):
            padding = [(0, 0)] + padding
        y = conv2d(x[:, None], kernel[None], bias, strides=(1,) + strides, padding=padding,
                   activation=activation, dtype=compute)[:, 0]
    else:
        y = conv2d(x, kernel, bias, strides=strides, padding=padding, activation=activation,
                   dtype=compute)
    if batch_dims != 1:
        y = jnp.reshape(y, batch_shape + y.shape[1:])
    return y, ""
