"""The fully-connected layer's passes (``cpp/layers/fc``) as JAX primitives, for every op
built on them.

``jb.dense`` is these passes; ``jb.conv2d`` reuses the activation gradient over its output's
pixels; ``jb.lstm``'s backward runs its input gradient and weight update as two of them over
every time step at once. Each pass is one XLA FFI call on 2-D operands (and the leading dims
of vmap, ``ops/primitive.py``):

* ``forward`` (``jb_fc_fwd``): ``y = act(x @ kernel + bias)``, bias and activation fused into
  the kernel's epilogue; the kernel is re-blocked (and cast to the computation dtype) inside
  the call. For gelu it also returns the pre-activation ``z``.
* ``activation_grad`` (``jb_fc_act_grad``): ``dz = dy * act'(saved)``, element-wise, from what
  the forward saved: the output ``y`` for relu, sigmoid and tanh, ``z`` for gelu.
* ``backward_data`` (``jb_fc_bwd``): ``dx = dz @ kernel.T``.
* ``weight_update`` (``jb_fc_upd``): ``dkernel = x.T @ dz`` and ``dbias = sum(dz)``, race-free.

Each is a primitive with its rules beside it, as ``lax.dot_general`` is: without an
activation the forward is linear in ``x`` and in ``(kernel, bias)``, and the three products
are each other's transposes (forward by ``x`` transposes into backward by data, by the
weights into the weight update); the activation gradient is linear in ``dy``. So the
forward's JVP is ``act'(saved) * (x @ dkernel + dbias + dx @ kernel)``, three passes, and
its transpose, which is reverse mode, is the activation gradient, backward by data and weight
update: the calls of a hand-written backward. Where ``dx`` is not needed (a first layer) its
tangent is a symbolic zero and the pass is never emitted.

``act`` is an activation code (``ACTIVATION_CODES``), static in every pass, and so is
``products``: 0 for exact products, or 1, 3 or 6 bfloat16 products of the float32 operands'
parts (``ops/emulation.py``'s method, split inside the call as the operands are re-blocked),
which the derivative passes use too.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from jax_brgemm import _activations
from jax_brgemm._native import ACTIVATION_CODES
from jax_brgemm.ops import partitioning
from jax_brgemm.ops.primitive import (define, is_zero, leading, shapes_of, unbroadcast, undefined,
                                      weight_update_jvp, zero, zero_like)

__all__ = ["ACTIVATION_CODES", "GELU", "NONE", "activation_grad", "backward_data", "forward",
           "preactivation_grad", "saved_for_backward", "weight_update"]

NONE, GELU = ACTIVATION_CODES["none"], ACTIVATION_CODES["gelu"]


def forward(x, kernel, bias, act, products=0):
    """``(y, z)``: ``act(x @ kernel + bias)`` and, for gelu, the pre-activation (else empty)."""
    b = _no_bias(x) if bias is None else bias.astype(jnp.float32)
    return tuple(forward_p.bind(x, kernel, b, act=act, products=products))


def activation_grad(dy, saved, act):
    """``dy * act'(saved)``."""
    return activation_grad_p.bind(dy, saved, act=act)


def backward_data(dz, kernel, products=0):
    """``dz @ kernel.T``; ``dz`` may have more columns than kernel (its first K are used)."""
    return backward_data_p.bind(dz, kernel, products=products)


def weight_update(x, dz, w_shape, w_dtype, with_bias, products=0):
    """``(x.T @ dz, the column sums of dz)`` over w_shape's C first columns of x and K of dz:
    the first in ``w_dtype``, the second float32 (empty without ``with_bias``)."""
    return tuple(weight_update_p.bind(x, dz, w_shape=tuple(w_shape), w_dtype=np.dtype(w_dtype),
                                      with_bias=bool(with_bias), products=products))


def saved_for_backward(act, y, z):
    """What the activation's derivative reads: nothing, the output ``y``, or ``z`` for gelu."""
    return None if act == NONE else z if act == GELU else y


def preactivation_grad(act, gy, gz, saved):
    """``dz`` from the cotangents of the forward's outputs ``y`` and ``z`` (``gy`` already in
    the computation dtype), over any leading dims: element-wise, so they run as rows."""
    if act == NONE:
        return gy
    k = gy.shape[-1]
    dz = activation_grad(gy.reshape(-1, k), saved.reshape(-1, k), act).reshape(gy.shape)
    if act == GELU:  # z is an output too
        dz = dz + gz.astype(dz.dtype)
    return dz


def _no_bias(x):
    """The empty bias, with ``x``'s leading dims (as size 1) like every operand of a pass."""
    return jnp.zeros((1,) * (x.ndim - 2) + (0,), jnp.float32)


# --- the custom calls --------------------------------------------------------------------
# Leading dims (vmap's) go to the handlers as they are; at top level each call is
# batch-partitionable: under jit with the rows of the mini-batch sharded, it runs per
# shard, and the weight update's partial sums are psum'ed.


def _fwd_ffi(x, kernel, b, *, act, products):
    lead, (n, k) = leading((x, 2), (kernel, 2), (b, 1)), (x.shape[-2], kernel.shape[-1])
    y = jax.ShapeDtypeStruct(lead + (n, k), x.dtype)
    z = jax.ShapeDtypeStruct(lead + ((n, k) if act == GELU else (0,)), x.dtype)
    return tuple(jax.ffi.ffi_call("jb_fc_fwd", (y, z))(x, kernel, b, act=np.int32(act), products=np.int64(products)))


def _act_grad_ffi(dy, saved, *, act):
    out = jax.ShapeDtypeStruct(leading((dy, 2), (saved, 2)) + dy.shape[-2:], dy.dtype)
    return tuple(jax.ffi.ffi_call("jb_fc_act_grad", (out,))(dy, saved, act=np.int32(act)))


def _bwd_ffi(dz, kernel, *, products):
    out = jax.ShapeDtypeStruct(leading((dz, 2), (kernel, 2)) + (dz.shape[-2], kernel.shape[-2]), dz.dtype)
    return tuple(jax.ffi.ffi_call("jb_fc_bwd", (out,))(dz, kernel, products=np.int64(products)))


def _upd_ffi(x, dz, *, w_shape, w_dtype, with_bias, products):
    lead = leading((x, 2), (dz, 2))
    dw = jax.ShapeDtypeStruct(lead + w_shape, w_dtype)
    db = jax.ShapeDtypeStruct(lead + ((w_shape[1],) if with_bias else (0,)), jnp.float32)
    return tuple(jax.ffi.ffi_call("jb_fc_upd", (dw, db))(x, dz, products=np.int64(products)))


_R, _SUM = partitioning.ROWS, partitioning.SUM


@partitioning.cached
def _fwd_target(act, products):
    return partitioning.rows(partial(_fwd_ffi, act=act, products=products), (_R, None, None), (_R, _R))


@partitioning.cached
def _act_grad_target(act):
    return partitioning.rows(partial(_act_grad_ffi, act=act), (_R, _R), (_R,))


@partitioning.cached
def _bwd_target(products):
    return partitioning.rows(partial(_bwd_ffi, products=products), (_R, None), (_R,))


@partitioning.cached
def _upd_target(w_shape, w_dtype, with_bias, products):
    return partitioning.rows(partial(_upd_ffi, w_shape=w_shape, w_dtype=w_dtype,
                                     with_bias=with_bias, products=products), (_R, _R), (_SUM, _SUM))


def _call(target, ffi, *operands, **params):
    """The partitionable call at top level, the bare one under leading dims."""
    if operands[0].ndim == 2:
        return target(**params)(*operands)
    return ffi(*operands, **params)


# --- forward --------------------------------------------------------------------------------

forward_p = define(
    "jb_fc_forward", shapes_of(_fwd_ffi),
    lambda x, kernel, b, *, act, products: _call(_fwd_target, _fwd_ffi, x, kernel, b, act=act, products=products),
    core_ranks=(2, 2, 1))


def _forward_jvp(primals, tangents, *, act, products):
    x, kernel, bias = primals
    dx, dkernel, dbias = tangents
    y, z = forward_p.bind(x, kernel, bias, act=act, products=products)
    # the pre-activation's tangent: x @ dkernel + dbias (one pass, the bias fused) + dx @ kernel
    dbias = None if bias.shape[-1] == 0 or is_zero(dbias) else dbias
    terms = []
    if not is_zero(dkernel):
        terms.append(forward_p.bind(x, dkernel, _no_bias(x) if dbias is None else dbias, act=NONE, products=products)[0])
        dbias = None
    if not is_zero(dx):
        terms.append(forward_p.bind(dx, kernel, _no_bias(x), act=NONE, products=products)[0])
    if dbias is not None:  # a bias tangent alone: broadcast in XLA
        terms.append(jnp.broadcast_to(dbias[..., None, :].astype(y.dtype), y.shape))
    if not terms:
        return (y, z), (zero(y), zero(z))
    dz = sum(terms[1:], terms[0])
    dy = dz if act == NONE else activation_grad_p.bind(dz, saved_for_backward(act, y, z), act=act)
    return (y, z), (dy, dz if act == GELU else zero(z))


def _forward_transpose(cts, x, kernel, bias, *, act, products):
    # linear (act NONE) in x, with no bias, or in (kernel, bias), as the JVP above uses it
    if act != NONE or undefined(x) == undefined(kernel):
        raise NotImplementedError("jb_fc_forward is transposed in x or in (kernel, bias) only, without an activation")
    ct = cts[0]
    if undefined(x):
        if is_zero(ct):
            return zero_like(x), None, None
        return unbroadcast(backward_data_p.bind(ct, kernel, products=products), x.aval.shape), None, None
    with_bias = undefined(bias)
    if is_zero(ct):
        return None, zero_like(kernel), zero_like(bias) if with_bias else None
    dw, db = weight_update(x, ct, kernel.aval.shape[-2:], kernel.aval.dtype, with_bias, products)
    db = unbroadcast(db.astype(bias.aval.dtype), bias.aval.shape) if with_bias else None
    return None, unbroadcast(dw, kernel.aval.shape), db


ad.primitive_jvps[forward_p] = _forward_jvp
ad.primitive_transposes[forward_p] = _forward_transpose


# --- activation gradient ----------------------------------------------------------------------

activation_grad_p = define(
    "jb_fc_activation_grad", shapes_of(_act_grad_ffi, single=True),
    lambda dy, saved, *, act: _call(_act_grad_target, _act_grad_ffi, dy, saved, act=act)[0],
    core_ranks=(2, 2), multiple_results=False)


def _activation_grad_jvp(primals, tangents, *, act):
    dy, saved = primals
    t_dy, t_saved = tangents
    out = activation_grad_p.bind(dy, saved, act=act)
    terms = [] if is_zero(t_dy) else [activation_grad_p.bind(t_dy, saved, act=act)]
    if not is_zero(t_saved):  # dy * act''(saved) * t_saved, element-wise in jnp
        name = _activations.name_of(act)
        _, d = jax.jvp(lambda s: dy.astype(jnp.float32) * _activations.derivative(name, s), (saved,), (t_saved,))
        terms.append(d.astype(out.dtype))
    if not terms:
        return out, zero(out)
    return out, sum(terms[1:], terms[0])


def _activation_grad_transpose(ct, dy, saved, *, act):
    if is_zero(ct):
        return zero_like(dy), None
    return unbroadcast(activation_grad_p.bind(ct, saved, act=act), dy.aval.shape), None


ad.primitive_jvps[activation_grad_p] = _activation_grad_jvp
ad.primitive_transposes[activation_grad_p] = _activation_grad_transpose


# --- backward by data: bilinear in (dz, kernel) ---------------------------------------------

backward_data_p = define(
    "jb_fc_backward_data", shapes_of(_bwd_ffi, single=True),
    lambda dz, kernel, *, products: _call(_bwd_target, _bwd_ffi, dz, kernel, products=products)[0],
    core_ranks=(2, 2), multiple_results=False)


def _widen(a, columns):
    """``a`` with zero columns up to ``columns`` (jb.lstm's padded rows read its first ones)."""
    extra = columns - a.shape[-1]
    return a if extra == 0 else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)])


def _backward_data_transpose_dz(ct, dz, kernel, *, products):
    d = forward_p.bind(ct, kernel, _no_bias(ct), act=NONE, products=products)[0]
    return unbroadcast(_widen(d, dz.aval.shape[-1]), dz.aval.shape)


def _backward_data_transpose_kernel(ct, dz, kernel, *, products):
    k = kernel.aval.shape[-1]
    dw, _ = weight_update(ct, dz, (ct.shape[-1], k), kernel.aval.dtype, False, products)
    return unbroadcast(dw, kernel.aval.shape)


ad.defbilinear(backward_data_p, _backward_data_transpose_dz, _backward_data_transpose_kernel)


# --- weight update: bilinear in (x, dz) -------------------------------------------------------

weight_update_p = define("jb_fc_weight_update", shapes_of(_upd_ffi), lambda x, dz, **params: _call(
    _upd_target, _upd_ffi, x, dz, **params), core_ranks=(2, 2))




def _weight_update_transpose(cts, x, dz, *, w_shape, w_dtype, with_bias, products):
    ct_w, ct_b = cts
    c, k = w_shape
    if undefined(x):  # d x = dz @ ct_w.T over x's first C columns
        if is_zero(ct_w):
            return zero_like(x), None
        d = backward_data_p.bind(dz, ct_w.astype(w_dtype), products=products)
        return unbroadcast(_widen(d, x.aval.shape[-1]).astype(x.aval.dtype), x.aval.shape), None
    # d dz = x @ ct_w + ct_b over dz's first K columns: the forward, the bias fused
    ct_b = ct_b if with_bias and not is_zero(ct_b) else None
    lead, n = dz.aval.shape[:-2], dz.aval.shape[-2]
    if is_zero(ct_w) and ct_b is None:
        return None, zero_like(dz)
    if is_zero(ct_w):
        d = jnp.broadcast_to(ct_b[..., None, :], lead + (n, k)).astype(dz.aval.dtype)
    else:
        d = forward_p.bind(x[..., :c], ct_w, _no_bias(x) if ct_b is None else ct_b, act=NONE, products=products)[0]
    return None, unbroadcast(_widen(d, dz.aval.shape[-1]).astype(dz.aval.dtype), dz.aval.shape)


ad.primitive_jvps[weight_update_p] = partial(weight_update_jvp, weight_update_p)
ad.primitive_transposes[weight_update_p] = _weight_update_transpose
