"""jb.conv2d: a 2-D convolution (NHWC x HWIO) as BRGEMM custom calls with a custom VJP.

Forward, backward-by-data and weight update are each one XLA FFI call into
``cpp/layers/conv`` (the paper's Algorithm 4 and its dual convolutions):

* ``jb_conv_fwd``: ``y = act(conv(x, kernel) + bias)``, bias and activation fused into the
  kernel's epilogue; the kernel is re-blocked (and cast to the compute dtype) inside the call.
* ``jb_fc_act_grad``: ``dz = dy * act'(saved)``, element-wise over the output's pixels
  (the fully-connected layer's pass, ``ops/fc_passes.py``).
* ``jb_conv_bwd``: ``dx``, the dual convolution of ``dz`` with the transposed kernel.
* ``jb_conv_upd``: ``dkernel`` and ``dbias``, reduced over the batch without races.

The backward is split in separate calls so that XLA drops ``dx`` where nobody needs it
(the first layer of a network).
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm import precision as _precision
from jax_brgemm.ops import emulation, fc_passes

_OP = "jb.conv2d"
_STOCK = "flax.linen.Conv (or jax.lax.conv_general_dilated)"


class NotPositive(ValueError, TypeError):
    """A dilation < 1: a ValueError as every bad size here, and the TypeError lax raises."""


@emulation.exact_on_infinity("x", "kernel")
def conv2d(x, kernel, bias=None, *, strides=(1, 1), padding="SAME", activation=None, dtype=None,
           rhs_dilation=1, lhs_dilation=1, feature_group_count=1, precision=None):
    """2-D convolution ``activation(conv(x, kernel) + bias)`` on the BRGEMM kernels.

    Same result as ``flax.linen.Conv`` / ``lax.conv_general_dilated`` with NHWC inputs and
    HWIO kernels.

    Args:
      x: ``(N, H, W, C)`` float32 or bfloat16. ``N = 0`` gives an empty result.
      kernel: ``(R, S, C / G, K)`` float32 or bfloat16 (Flax's ``Conv`` kernel layout), G
        the feature groups.
      bias: optional ``(K,)``.
      strides: an int or a pair of ints >= 1.
      padding: ``"SAME"`` (as XLA: ``lax.padtype_to_pads``, the extra row / column at the
        bottom / right), ``"VALID"``, an int (both sides of both dims), or a pair of
        per-dimension paddings, each an int or a ``(low, high)`` pair, all >= 0.
      activation: ``None``, ``"relu"``, ``"gelu"``, ``"sigmoid"`` or ``"tanh"``, fused.
      dtype: the computation dtype (float32 or bfloat16); ``None`` promotes the arguments'
        dtypes. Accumulation, bias and activation are float32; gradients come back in
        each argument's own dtype.
      rhs_dilation: the kernel dilation (flax's ``kernel_dilation``), an int or a pair of
        ints >= 1: tap ``(r, s)`` reads input pixel ``(p * sh + r * dh, q * sw + s * dw)``
        of the padded input. ``"SAME"`` pads for the dilated kernel, as lax does.
      lhs_dilation: the input dilation (flax's ``input_dilation``; a transposed convolution
        with strides ``lhs_dilation``), an int or a pair of ints >= 1: ``lhs_dilation - 1``
        zeros between neighbouring input pixels before padding. It takes explicit padding
        only (as lax). With strides 1 it is the backward by data of the strided convolution
        it transposes; with strides > 1 too the zeros are inserted and the strided
        convolution runs on them.
      feature_group_count: G >= 1, dividing C and K: output channel ``k`` reduces over the
        ``C / G`` input channels of its group ``k // (K / G)`` only (grouped; depthwise when
        G = C), as in lax.
      precision: the accuracy asked of the products, as ``lax.conv_general_dilated`` takes
        it (a ``lax.Precision``, a pair, a ``lax.DotAlgorithmPreset`` or their names; None
        follows ``jax.default_matmul_precision``), met as ``jax_brgemm.precision`` says:
        exact float32 products, or where it emulates them (AMX) and float32 ``dtype``
        bfloat16 ones summed in float32 (``ops/emulation.py``), in every pass. An algorithm
        outside its table is a ValueError.

    Returns:
      ``(N, P, Q, K)`` in ``dtype``.

    Sizes of 0 (N, H, W, C or K) and outputs without pixels (a VALID kernel larger than the
    input) compute what ``lax.conv_general_dilated`` computes, in XLA: an empty result, or
    for C = 0 the activation of the bias. So does float64 (with ``jax_enable_x64``).
    """
    x = check.array(x, "x", _OP, check.OP_DTYPES)
    kernel = check.array(kernel, "kernel", _OP, check.OP_DTYPES)
    if bias is not None:
        bias = check.array(bias, "bias", _OP, check.OP_DTYPES)
    act = check.activation(activation, _OP)
    computed = _precision.computed(_precision.accuracy(precision, _OP), _OP)
    check.rank(kernel, "kernel", _OP, "HWIO (R, S, C, K)", exactly=4)
    check.rank(x, "x", _OP, "NHWC (N, H, W, C)", exactly=4)
    r, s, cg, k = kernel.shape
    n, h, w, c = x.shape
    groups = feature_groups(feature_group_count, x.shape, kernel.shape, _OP)
    if bias is not None:
        check.shape(bias, "bias", _OP, (k,), "(K,)")
    if r < 1 or s < 1:  # lax refuses an empty window too
        raise ValueError(f"{_OP}: the kernel's window must be at least 1x1, got R={r}, S={s}")
    st = spatial_ints(strides, "strides", 2)
    dil = spatial_ints(rhs_dilation, "rhs_dilation", 2, NotPositive)
    ldil = spatial_ints(lhs_dilation, "lhs_dilation", 2, NotPositive)
    if max(ldil) > 1 and isinstance(padding, str):
        raise ValueError(f"{_OP}: padding {padding!r} with lhs_dilation {ldil}: string padding is not "
                         "implemented for input-dilated convolutions (as in lax); give explicit pads")
    dilated = (max(0, (h - 1) * ldil[0] + 1), max(0, (w - 1) * ldil[1] + 1))
    pads = resolve_padding(padding, dilated, ((r - 1) * dil[0] + 1, (s - 1) * dil[1] + 1), st)
    dtype = check.compute_dtype(_OP, dtype, x, kernel, bias, dtypes=check.OP_DTYPES)
    x = x.astype(dtype)
    # (activation, strides, pads, dilations, groups, the accuracy computed: ops/emulation.py)
    cfg = (act, st, pads, dil, groups, computed if dtype == jnp.float32 else "float32")
    out = _out_shape((n,) + dilated + (c,), kernel.shape, cfg)
    # an empty input with padding can still have output pixels (all padding)
    if min(out + (h, w, c)) < 1 or dtype not in check.KERNEL_DTYPES:
        return _conv_xla(x, kernel, bias, activation, cfg, dtype, ldil)
    kernel, bias = check.kernel_operand(kernel, dtype), check.kernel_operand(bias, jnp.float32)
    if max(ldil) > 1 and max(st) > 1:  # rare: the zeros inserted, then a strided convolution
        x = lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0),) + tuple((0, 0, d - 1) for d in ldil) + ((0, 0, 0),))
    elif max(ldil) > 1:
        return _input_dilated(x, kernel, bias, activation, cfg, ldil, out)
    return _conv(x, kernel, bias, cfg)


def _input_dilated(x, kernel, bias, activation, cfg, ldil, out):
    """The input-dilated (transposed) convolution as the backward by data of the strided
    convolution it transposes: strides ldil, the kernel flipped with its channels swapped
    (per group), pads (R - 1) * dh - pad. Output rows beyond the kernel's reach (a pad larger
    than that) are zeros, added around; bias and activation follow in XLA."""
    pads, dil, groups = cfg[2:5]
    r, s, cg, k = kernel.shape
    n, _, _, c = x.shape
    reach = ((r - 1) * dil[0], (s - 1) * dil[1])
    zeros = [(max(0, lo - e), max(0, hi - e)) for (lo, hi), e in zip(pads, reach, strict=True)]
    tpads = tuple((e - lo + zl, e - hi + zh) for (lo, hi), e, (zl, zh) in zip(pads, reach, zeros, strict=True))
    core = tuple(o - zl - zh for o, (zl, zh) in zip(out[1:3], zeros, strict=True))
    if min(core) < 1:  # nothing but zeros: XLA
        return _conv_xla(x, kernel, bias, activation, cfg, x.dtype, ldil)
    # w_t[r, s, j, g * cg + i] = w[R - 1 - r, S - 1 - s, i, g * kg + j]
    w_t = kernel[::-1, ::-1].reshape(r, s, cg, groups, k // groups).transpose(0, 1, 4, 3, 2)
    w_t = w_t.reshape(r, s, k // groups, c)
    y = _conv_bwd_pass(x, w_t, (n,) + core + (k,), (fc_passes.NONE, ldil, tpads, dil, groups, cfg[5]))
    if any(v for pair in zeros for v in pair):
        y = jnp.pad(y, ((0, 0),) + tuple(zeros) + ((0, 0),))
    if bias is None and activation is None:
        return y
    y = y.astype(jnp.float32) + (0 if bias is None else bias)
    return _activations.apply(activation, y).astype(x.dtype)


def _conv_xla(x, kernel, bias, activation, cfg, dtype, ldil=(1, 1)):
    """What the kernels compute, in XLA: for sizes they do not take (0, or no output
    pixels), for float64 and for input dilation with strides."""
    strides, pads, dil, groups = cfg[1:5]
    acc = jnp.promote_types(dtype, jnp.float32)
    y = lax.conv_general_dilated(x, kernel.astype(dtype), strides, pads, lhs_dilation=ldil, rhs_dilation=dil,
                                 feature_group_count=groups,
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return _activations.apply(activation, y).astype(dtype)


def resolve_padding(padding, spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int], op=_OP):
    """Flax's padding forms as explicit ((low, high), ...) pairs, one per spatial dim:
    "SAME" / "VALID" as XLA computes them (``lax.padtype_to_pads``), an int for every side,
    or one int or (low, high) pair per dim. Negative paddings are a ValueError."""
    rank = len(spatial)
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID", "SAME_LOWER"):
            raise ValueError(f"{op}: padding {padding!r} is not supported here (SAME, VALID, an int "
                             f"or explicit pairs); for other modes use {_STOCK}")
        pads = lax.padtype_to_pads(tuple(spatial), tuple(kernel), tuple(strides), padding.upper())
    elif isinstance(padding, (int, np.integer)) and not isinstance(padding, bool):
        pads = [(int(padding), int(padding))] * rank
    elif isinstance(padding, Sequence) and len(padding) == rank:
        pads = []
        for pd in padding:
            if isinstance(pd, (int, np.integer)) and not isinstance(pd, bool):
                pads.append((int(pd), int(pd)))
            elif (isinstance(pd, Sequence) and len(pd) == 2
                  and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in pd)):
                pads.append((int(pd[0]), int(pd[1])))
            else:
                raise ValueError(f"{op}: invalid padding {padding!r}: each entry must be an int or a "
                                 "(low, high) pair of ints")
    else:
        raise ValueError(f"{op}: invalid padding {padding!r}: expected 'SAME', 'VALID', an int or "
                         f"a sequence of {rank} ints or (low, high) pairs")
    pads = tuple((int(lo), int(hi)) for lo, hi in pads)
    if any(v < 0 for pair in pads for v in pair):
        raise ValueError(f"{op}: paddings must be >= 0, got {pads}")
    return pads


def feature_groups(value, x_shape, kernel_shape, op=_OP):
    """feature_group_count: an int >= 1 dividing the input and output channels, with the
    kernel's input channels one group's, as lax has it."""
    (c, cg, k) = x_shape[-1], *kernel_shape[-2:]
    check.integers(op, feature_group_count=value)
    g = int(value)
    if g < 1:
        raise ValueError(f"{op}: feature_group_count must be >= 1, got {g}")
    if c % g or k % g:
        raise ValueError(f"{op}: feature_group_count={g} must divide the input channels ({c}) and the "
                         f"output channels ({k})")
    if c != cg * g:
        hint = (f"; for a grouped convolution pass feature_group_count={c // cg}"
                if cg and c % cg == 0 and c > cg and g == 1 else "")
        raise ValueError(f"{op}: x {tuple(x_shape)} has {c} channels but kernel {tuple(kernel_shape)} in "
                         f"{g} feature group(s) expects C = {cg * g}{hint}")
    return g


def spatial_ints(value, name, rank, below_one=ValueError, op=_OP):
    """One int >= 1 per spatial dim (strides, dilations). Like lax, a non-integer (1.5, or
    2.0) is a TypeError, never truncated; a wrong count is a ValueError, a value < 1
    `below_one`."""
    what = "an int or a pair of ints" if rank == 2 else f"an int or a sequence of {rank} ints"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,) * rank
    if not isinstance(value, (Sequence, np.ndarray)) or np.ndim(value) != 1:
        raise TypeError(f"{op}: {name} must be {what}, got {value!r}")
    if len(value) != rank:
        raise ValueError(f"{op}: {name} must be {what}, got {value!r}")
    check.integers(op, **{f"{name}[{i}]": v for i, v in enumerate(value)})
    ints = tuple(int(v) for v in value)
    if min(ints) < 1:
        raise below_one(f"{op}: {name} must be >= 1, got {ints}")
    return ints


# --- the custom calls --------------------------------------------------------------------
# vmap_method="expand_dims": under vmap every operand arrives with the batch dims in front
# (size 1 when unbatched); with a shared kernel the handlers fold them into the mini-batch.


def _attrs(cfg):  # the geometry, and the emulated products of the accuracy computed
    (sh, sw), ((pt, pb), (pl, pr)), (dh, dw), groups = cfg[1:5]
    products = len(emulation.TERMS[cfg[5]]) if cfg[5] != "float32" else 0
    return dict(sh=np.int64(sh), sw=np.int64(sw), pt=np.int64(pt), pb=np.int64(pb), pl=np.int64(pl),
                pr=np.int64(pr), dh=np.int64(dh), dw=np.int64(dw), g=np.int64(groups), products=np.int64(products))


def _out_shape(x_shape, k_shape, cfg):
    (sh, sw), ((pt, pb), (pl, pr)), (dh, dw) = cfg[1:4]
    n, h, w, _ = x_shape
    r, s, _, k = k_shape
    return (n, (h + pt + pb - (r - 1) * dh - 1) // sh + 1, (w + pl + pr - (s - 1) * dw - 1) // sw + 1, k)


# With an emulated accuracy (cfg[5]) each pass splits its float32 operands into bfloat16
# parts itself and sums their products (the products attr; ops/emulation.py).


def _forward(x, kernel, bias, cfg):
    act = cfg[0]
    shape = _out_shape(x.shape, kernel.shape, cfg)
    b = jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    y = jax.ShapeDtypeStruct(shape, x.dtype)
    z = jax.ShapeDtypeStruct(shape if act == fc_passes.GELU else (0,), x.dtype)
    return jax.ffi.ffi_call("jb_conv_fwd", (y, z), vmap_method="expand_dims")(
        x, kernel, b, act=np.int32(act), **_attrs(cfg))


def _backward(dz, kernel, x_shape, cfg):
    out = jax.ShapeDtypeStruct(x_shape, dz.dtype)
    return jax.ffi.ffi_call("jb_conv_bwd", out, vmap_method="expand_dims")(dz, kernel, **_attrs(cfg))


def _update(x, dz, w_shape, w_dtype, with_bias, cfg):
    dw = jax.ShapeDtypeStruct(w_shape, w_dtype)
    db = jax.ShapeDtypeStruct((w_shape[-1] if with_bias else 0,), jnp.float32)
    return jax.ffi.ffi_call("jb_conv_upd", (dw, db), vmap_method="expand_dims")(x, dz, **_attrs(cfg))


# --- the differentiable passes -------------------------------------------------------------
# As in ops/fc_passes.py: each pass is a custom_vjp function whose bwd is made of the
# others and whose fwd computes its outputs by calling itself, so an outer differentiation
# (grad of grad) sees only differentiable functions. The geometry (activation, strides,
# pads, dilations, groups) is static.


def _conv(x, kernel, bias, cfg):
    return _conv_pass(x, kernel, bias, cfg)[0]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv_pass(x, kernel, bias, cfg):
    """(y, z) = (act(conv(x, kernel) + bias), the pre-activation for gelu or an empty array)."""
    return _forward(x, kernel, bias, cfg)


def _conv_pass_fwd(x, kernel, bias, cfg):
    y, z = _conv_pass(x, kernel, bias, cfg)
    return (y, z), (x, kernel, bias, fc_passes.saved_for_backward(cfg[0], y, z))


def _conv_pass_bwd(cfg, res, cotangents):
    x, kernel, bias, saved = res
    gy, gz = cotangents
    dz = fc_passes.preactivation_grad(cfg[0], gy.astype(x.dtype), gz, saved)
    dx = _conv_bwd_pass(dz, kernel, x.shape, cfg)
    dw, db = _conv_upd(x, dz, kernel.shape, np.dtype(kernel.dtype), bias is not None, cfg)
    return dx, dw, None if bias is None else db.astype(bias.dtype)


_conv_pass.defvjp(_conv_pass_fwd, _conv_pass_bwd)


def _linear(cfg):
    """The same geometry without the activation (the passes below are linear)."""
    return (fc_passes.NONE,) + tuple(cfg[1:])


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv_bwd_pass(dz, kernel, x_shape, cfg):
    """dx: the transposed convolution of dz (the dual convolution)."""
    return _backward(dz, kernel, x_shape, cfg)


def _conv_bwd_pass_fwd(dz, kernel, x_shape, cfg):
    return _conv_bwd_pass(dz, kernel, x_shape, cfg), (dz, kernel)


def _conv_bwd_pass_bwd(x_shape, cfg, res, g):
    # <g, conv^T_w(dz)> = <conv_w(g), dz>: d dz = conv_w(g), d w = upd(g, dz)
    dz, kernel = res
    g = g.astype(dz.dtype)
    d_dz = _conv(g, kernel, None, _linear(cfg))
    d_kernel, _ = _conv_upd(g, dz, kernel.shape, np.dtype(kernel.dtype), False, cfg)
    return d_dz.astype(dz.dtype), d_kernel


_conv_bwd_pass.defvjp(_conv_bwd_pass_fwd, _conv_bwd_pass_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _conv_upd(x, dz, w_shape, w_dtype, with_bias, cfg):
    """(dkernel in w_dtype, dbias: the sums of dz over (N, P, Q) in float32, or empty)."""
    return _update(x, dz, w_shape, w_dtype, with_bias, cfg)


def _conv_upd_fwd(x, dz, w_shape, w_dtype, with_bias, cfg):
    return _conv_upd(x, dz, w_shape, w_dtype, with_bias, cfg), (x, dz)


def _conv_upd_bwd(w_shape, w_dtype, with_bias, cfg, res, cotangents):
    # <g_w, upd(x, dz)> + <g_b, sum dz> = <conv_{g_w}(x) + g_b, dz>
    x, dz = res
    g_w, g_b = cotangents
    g_w = g_w.astype(x.dtype)
    d_x = _conv_bwd_pass(dz, g_w, x.shape, _linear(cfg))
    d_dz = _conv(x, g_w, g_b if with_bias else None, _linear(cfg))
    return d_x.astype(x.dtype), d_dz.astype(dz.dtype)


_conv_upd.defvjp(_conv_upd_fwd, _conv_upd_bwd)
