"""jb.conv3d: a 3-D convolution (NDHWC x DHWIO) as one 2-D convolution on the kernels.

The batch-reduce of a 3-D convolution runs over the taps ``(t, r, s)`` and the channels.
The depth taps are folded into the channels: for every output depth ``o`` the ``T`` input
planes ``o * sd + t * dd`` are laid side by side (per feature group), and the kernel's
depth taps become its input channels. What is left is a 2-D convolution of
``N * D_out`` images with ``T * C`` channels, run by ``jb.conv2d`` with its primitives; the
gradients of the fold (slices and a transpose) are XLA's. The fold copies the input ``T``
times, once per depth tap (none for ``T = 1``). A depthwise layer (one input channel per
group) is not folded, which would make groups of ``T`` channels: it is ``T`` depthwise 2-D
passes, one per depth tap, summed in float32.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm import precision as _precision
from jax_brgemm.ops.conv import NotPositive, conv2d, feature_groups, resolve_padding, spatial_ints

_OP = "jb.conv3d"


def conv3d(x, kernel, bias=None, *, strides=(1, 1, 1), padding="SAME", activation=None, dtype=None,
           rhs_dilation=1, lhs_dilation=1, feature_group_count=1, precision=None):
    """3-D convolution ``activation(conv(x, kernel) + bias)`` on the BRGEMM kernels.

    Same result as ``flax.linen.Conv`` / ``lax.conv_general_dilated`` with NDHWC inputs and
    DHWIO kernels. The arguments are ``jb.conv2d``'s with one more spatial dim: ``x``
    ``(N, D, H, W, C)``, ``kernel`` ``(T, R, S, C / G, K)``, ``strides``, ``rhs_dilation``
    and ``lhs_dilation`` an int or three, ``padding`` ``"SAME"``, ``"VALID"``, an int or
    three ints / ``(low, high)`` pairs (explicit with ``lhs_dilation``, as in lax).

    Returns:
      ``(N, D_out, P, Q, K)`` in ``dtype``.
    """
    x = check.array(x, "x", _OP, check.OP_DTYPES)
    kernel = check.array(kernel, "kernel", _OP, check.OP_DTYPES)
    if bias is not None:
        bias = check.array(bias, "bias", _OP, check.OP_DTYPES)
    check.activation(activation, _OP)
    _precision.accuracy(precision, _OP)
    check.rank(kernel, "kernel", _OP, "DHWIO (T, R, S, C, K)", exactly=5)
    check.rank(x, "x", _OP, "NDHWC (N, D, H, W, C)", exactly=5)
    t, r, s, cg, k = kernel.shape
    n = x.shape[0]
    groups = feature_groups(feature_group_count, x.shape, kernel.shape, _OP)
    if bias is not None:
        check.shape(bias, "bias", _OP, (k,), "(K,)")
    if min(t, r, s) < 1:  # lax refuses an empty window too
        raise ValueError(f"{_OP}: the kernel's window must be at least 1x1x1, got {kernel.shape[:3]}")
    st = spatial_ints(strides, "strides", 3, op=_OP)
    dil = spatial_ints(rhs_dilation, "rhs_dilation", 3, NotPositive, op=_OP)
    ldil = spatial_ints(lhs_dilation, "lhs_dilation", 3, NotPositive, op=_OP)
    if max(ldil) > 1 and isinstance(padding, str):
        raise ValueError(f"{_OP}: padding {padding!r} with lhs_dilation {ldil}: string padding is not "
                         "implemented for input-dilated convolutions (as in lax); give explicit pads")
    dilated = tuple(max(0, (v - 1) * ld + 1) for v, ld in zip(x.shape[1:4], ldil, strict=True))
    window = tuple((v - 1) * dl + 1 for v, dl in zip((t, r, s), dil, strict=True))
    pads = resolve_padding(padding, dilated, window, st, _OP)
    depth = (dilated[0] + sum(pads[0]) - window[0]) // st[0] + 1
    if depth < 1 or n == 0 or cg == 0:  # no output, or nothing to reduce: XLA
        return _conv3d_xla(x, kernel, bias, activation, dtype, (st, pads, dil, ldil, groups))
    planes = _depth_planes(x, t, depth, (st[0], pads[0], dil[0], ldil[0]))
    conv = dict(strides=st[1:], padding=pads[1:], dtype=dtype, rhs_dilation=dil[1:], lhs_dilation=ldil[1:],
                feature_group_count=groups, precision=precision)
    if cg == 1 and t > 1:  # depthwise: T depthwise passes summed (folded, groups of T channels)
        out = check.compute_dtype(_OP, dtype, x, kernel, bias, dtypes=check.OP_DTYPES)
        y = sum(conv2d(plane, kernel[i], bias if i == 0 else None, **conv).astype(jnp.float32)
                for i, plane in enumerate(planes))
        y = _activations.apply(activation, y).astype(out)
    else:  # kernel (T, R, S, Cg, K) -> (R, S, T * Cg, K): tap t of channel c is channel t * Cg + c
        kernel2d = jnp.transpose(kernel, (1, 2, 0, 3, 4)).reshape(r, s, t * cg, k)
        y = conv2d(_fold(planes, groups), kernel2d, bias, activation=activation, **conv)
    return y.reshape((n, depth) + y.shape[1:])


def _depth_planes(x, taps, depth, geometry):
    """Per depth tap, the ``(N * depth, H, W, C)`` input planes its outputs read."""
    stride, (lo, hi), dilation, input_dilation = geometry
    n, _, h, w, c = x.shape
    x = lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0), (lo, hi, input_dilation - 1)) + ((0, 0, 0),) * 3)
    return [lax.slice_in_dim(x, i * dilation, i * dilation + (depth - 1) * stride + 1, stride, axis=1)
            .reshape(n * depth, h, w, c) for i in range(taps)]


def _fold(planes, groups):
    """``(N * depth, H, W, G * T * Cg)``: the planes side by side, each group's channels kept
    together (tap-major within the group)."""
    if len(planes) == 1:
        return planes[0]
    m, h, w, c = planes[0].shape
    x = jnp.stack(planes, axis=-2).reshape(m, h, w, len(planes), groups, c // groups)
    return jnp.swapaxes(x, 3, 4).reshape(m, h, w, len(planes) * c)


def _conv3d_xla(x, kernel, bias, activation, dtype, geometry):
    """Sizes without output or reduction (0, or a window beyond the padded depth): what lax
    computes, in XLA."""
    strides, pads, dil, ldil, groups = geometry
    dtype = check.compute_dtype(_OP, dtype, x, kernel, bias, dtypes=check.OP_DTYPES)
    acc = jnp.promote_types(dtype, jnp.float32)
    y = lax.conv_general_dilated(x.astype(dtype), kernel.astype(dtype), strides, pads, lhs_dilation=ldil,
                                 rhs_dilation=dil, feature_group_count=groups,
                                 dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), preferred_element_type=acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return _activations.apply(activation, y).astype(dtype)
