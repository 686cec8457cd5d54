"""jb.conv2d: a 2-D convolution (NHWC x HWIO) as BRGEMM custom calls, each a JAX primitive.

Forward, backward-by-data and weight update are each one XLA FFI call into
``cpp/layers/conv`` (the paper's Algorithm 4 and its dual convolutions):

* ``jb_conv_fwd``: ``y = act(conv(x, kernel) + bias)``, bias and activation fused into the
  kernel's epilogue; the kernel is re-blocked (and cast to the compute dtype) inside the call.
* ``jb_fc_act_grad``: ``dz = dy * act'(saved)``, element-wise over the output's pixels
  (the fully-connected layer's pass, ``ops/fc_passes.py``).
* ``jb_conv_bwd``: ``dx``, the dual convolution of ``dz`` with the transposed kernel.
* ``jb_conv_upd``: ``dkernel`` and ``dbias``, reduced over the batch without races.

Reverse mode is the transpose of the forward's tangent, split in separate calls so that no
``dx`` is computed where nobody needs it (the first layer of a network).
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm import precision as _precision
from jax_brgemm.ops import emulation, fc_passes
from jax_brgemm.ops.primitive import (define, is_zero, leading, shapes_of, unbroadcast, undefined,
                                      weight_update_jvp, zero, zero_like)

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
# Leading dims (vmap's, ops/primitive.py) go to the handlers as they are: with a shared kernel
# they fold them into the mini-batch.


def _attrs(cfg):  # the geometry, and the emulated products of the accuracy computed
    (sh, sw), ((pt, pb), (pl, pr)), (dh, dw), groups = cfg[1:5]
    products = len(emulation.TERMS[cfg[5]]) if cfg[5] != "float32" else 0
    return dict(sh=np.int64(sh), sw=np.int64(sw), pt=np.int64(pt), pb=np.int64(pb), pl=np.int64(pl),
                pr=np.int64(pr), dh=np.int64(dh), dw=np.int64(dw), g=np.int64(groups), products=np.int64(products))


def _out_shape(x_shape, k_shape, cfg):
    (sh, sw), ((pt, pb), (pl, pr)), (dh, dw) = cfg[1:4]
    n, h, w, _ = x_shape[-4:]
    r, s, _, k = k_shape[-4:]
    return (n, (h + pt + pb - (r - 1) * dh - 1) // sh + 1, (w + pl + pr - (s - 1) * dw - 1) // sw + 1, k)


# With an emulated accuracy (cfg[5]) each pass splits its float32 operands into bfloat16
# parts itself and sums their products (the products attr; ops/emulation.py).


def _forward(x, kernel, b, *, cfg):
    act = cfg[0]
    lead = leading((x, 4), (kernel, 4), (b, 1))
    shape = lead + _out_shape(x.shape, kernel.shape, cfg)
    y = jax.ShapeDtypeStruct(shape, x.dtype)
    z = jax.ShapeDtypeStruct(shape if act == fc_passes.GELU else lead + (0,), x.dtype)
    return tuple(jax.ffi.ffi_call("jb_conv_fwd", (y, z))(x, kernel, b, act=np.int32(act), **_attrs(cfg)))


def _backward(dz, kernel, *, x_shape, cfg):
    out = jax.ShapeDtypeStruct(leading((dz, 4), (kernel, 4)) + x_shape, dz.dtype)
    return jax.ffi.ffi_call("jb_conv_bwd", out)(dz, kernel, **_attrs(cfg))


def _update(x, dz, *, w_shape, w_dtype, with_bias, cfg):
    lead = leading((x, 4), (dz, 4))
    dw = jax.ShapeDtypeStruct(lead + w_shape, w_dtype)
    db = jax.ShapeDtypeStruct(lead + ((w_shape[-1],) if with_bias else (0,)), jnp.float32)
    return tuple(jax.ffi.ffi_call("jb_conv_upd", (dw, db))(x, dz, **_attrs(cfg)))


def _linear(cfg):
    """The same geometry without the activation (the passes below are linear)."""
    return (fc_passes.NONE,) + tuple(cfg[1:])


def _no_bias(x):
    return jnp.zeros((1,) * (x.ndim - 4) + (0,), jnp.float32)


def _conv(x, kernel, bias, cfg):
    b = _no_bias(x) if bias is None else bias.astype(jnp.float32)
    return forward_p.bind(x, kernel, b, cfg=cfg)[0]


def _conv_bwd_pass(dz, kernel, x_shape, cfg):
    return backward_data_p.bind(dz, kernel, x_shape=tuple(x_shape[-4:]), cfg=_linear(cfg))


def _conv_upd(x, dz, w_shape, w_dtype, with_bias, cfg):
    return weight_update_p.bind(x, dz, w_shape=tuple(w_shape[-4:]), w_dtype=np.dtype(w_dtype),
                                with_bias=with_bias, cfg=_linear(cfg))


# --- the passes as primitives ----------------------------------------------------------------
# As in ops/fc_passes.py: without its activation the forward is linear in x and in (kernel,
# bias), and forward, backward by data (the dual convolution) and weight update are each
# other's transposes. The forward's JVP is act'(saved) * (conv(x, dkernel) + dbias +
# conv(dx, kernel)); its transpose, reverse mode, is the activation gradient (the FC pass over
# the output's pixels), backward by data and weight update. cfg (activation, strides, pads,
# dilations, groups, accuracy) is static.

forward_p = define("jb_conv_forward", shapes_of(_forward), _forward, core_ranks=(4, 4, 1), partitioned=False)


def _forward_jvp(primals, tangents, *, cfg):
    (x, kernel, bias), (dx, dkernel, dbias) = primals, tangents
    act = cfg[0]
    y, z = forward_p.bind(x, kernel, bias, cfg=cfg)
    dbias = None if bias.shape[-1] == 0 or is_zero(dbias) else dbias
    terms = []
    if not is_zero(dkernel):
        terms.append(forward_p.bind(x, dkernel, _no_bias(x) if dbias is None else dbias, cfg=_linear(cfg))[0])
        dbias = None
    if not is_zero(dx):
        terms.append(forward_p.bind(dx, kernel, _no_bias(x), cfg=_linear(cfg))[0])
    if dbias is not None:  # a bias tangent alone: broadcast in XLA
        lead = dbias.shape[:-1]
        terms.append(jnp.broadcast_to(dbias.reshape(lead + (1, 1, 1, -1)).astype(y.dtype), y.shape))
    if not terms:
        return (y, z), (zero(y), zero(z))
    dz = sum(terms[1:], terms[0])
    if act == fc_passes.NONE:
        return (y, z), (dz, zero(z))
    k = y.shape[-1]
    saved = fc_passes.saved_for_backward(act, y, z)
    dy = fc_passes.activation_grad(dz.reshape(-1, k), saved.reshape(-1, k), act).reshape(y.shape)
    return (y, z), (dy, dz if act == fc_passes.GELU else zero(z))


def _forward_transpose(cts, x, kernel, bias, *, cfg):
    if cfg[0] != fc_passes.NONE or undefined(x) == undefined(kernel):
        raise NotImplementedError("jb_conv_forward is transposed in x or in (kernel, bias) only, without an activation")
    ct = cts[0]
    if undefined(x):
        if is_zero(ct):
            return zero_like(x), None, None
        return unbroadcast(_conv_bwd_pass(ct, kernel, x.aval.shape, cfg), x.aval.shape), None, None
    with_bias = undefined(bias)
    if is_zero(ct):
        return None, zero_like(kernel), zero_like(bias) if with_bias else None
    dw, db = _conv_upd(x, ct, kernel.aval.shape, kernel.aval.dtype, with_bias, cfg)
    db = unbroadcast(db.astype(bias.aval.dtype), bias.aval.shape) if with_bias else None
    return None, unbroadcast(dw, kernel.aval.shape), db


ad.primitive_jvps[forward_p] = _forward_jvp
ad.primitive_transposes[forward_p] = _forward_transpose

backward_data_p = define("jb_conv_backward_data", shapes_of(_backward, single=True), _backward, core_ranks=(4, 4),
                         multiple_results=False, partitioned=False)


def _backward_data_transpose_dz(ct, dz, kernel, *, x_shape, cfg):
    # <ct, conv^T_w(dz)> = <conv_w(ct), dz>
    return unbroadcast(_conv(ct, kernel, None, cfg).astype(dz.aval.dtype), dz.aval.shape)


def _backward_data_transpose_kernel(ct, dz, kernel, *, x_shape, cfg):
    dw, _ = _conv_upd(ct, dz, kernel.aval.shape, kernel.aval.dtype, False, cfg)
    return unbroadcast(dw, kernel.aval.shape)


ad.defbilinear(backward_data_p, _backward_data_transpose_dz, _backward_data_transpose_kernel)

weight_update_p = define("jb_conv_weight_update", shapes_of(_update), _update, core_ranks=(4, 4), partitioned=False)




def _weight_update_transpose(cts, x, dz, *, w_shape, w_dtype, with_bias, cfg):
    # <g_w, upd(x, dz)> + <g_b, sum dz> = <conv_{g_w}(x) + g_b, dz>
    g_w, g_b = cts
    g_b = g_b if with_bias and not is_zero(g_b) else None
    if undefined(x):
        if is_zero(g_w):
            return zero_like(x), None
        d_x = _conv_bwd_pass(dz, g_w.astype(dz.dtype), x.aval.shape, cfg)
        return unbroadcast(d_x.astype(x.aval.dtype), x.aval.shape), None
    if is_zero(g_w) and g_b is None:
        return None, zero_like(dz)
    if is_zero(g_w):
        d_dz = jnp.broadcast_to(g_b.reshape(g_b.shape[:-1] + (1, 1, 1, -1)), dz.aval.shape)
    else:
        d_dz = _conv(x, g_w.astype(x.dtype), g_b, cfg)
    return None, unbroadcast(d_dz.astype(dz.aval.dtype), dz.aval.shape)


ad.primitive_jvps[weight_update_p] = partial(weight_update_jvp, weight_update_p)
ad.primitive_transposes[weight_update_p] = _weight_update_transpose
