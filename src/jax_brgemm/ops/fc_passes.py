"""The fully-connected layer's passes (``cpp/layers/fc``), for every op built on them.

``jb.dense`` is these passes; ``jb.conv2d`` reuses the activation gradient over its output's
pixels; ``jb.lstm``'s backward runs its input gradient and weight update as two of them over
every time step at once. Each pass is one XLA FFI call on 2-D operands:

* ``jb_fc_fwd``: ``y = act(x @ kernel + bias)``, bias and activation fused into the kernel's
  epilogue; the kernel is re-blocked (and cast to the computation dtype) inside the call.
  For gelu it also returns the pre-activation ``z``.
* ``jb_fc_act_grad``: ``dz = dy * act'(saved)``, element-wise, from what the forward saved:
  the output ``y`` for relu, sigmoid and tanh (no extra memory: it is the result), ``z``
  for gelu.
* ``jb_fc_bwd``: ``dx = dz @ kernel.T`` (backward by data).
* ``jb_fc_upd``: ``dkernel = x.T @ dz`` and ``dbias = sum(dz)``, race-free (weight update).

Two levels of each:

* ``forward_call``, ``activation_grad_call``, ``backward_data_call``, ``weight_update_call``:
  the bare call, batch-partitionable (``partitioning.rows``), not differentiable. For a
  backward rule that needs a pass and never its gradient, and for timing a pass alone.
* ``forward``, ``activation_grad``, ``backward_data``, ``weight_update``: the same calls as
  ``custom_vjp`` functions whose backward is made of the others (the backward of a linear
  pass is a linear pass: forward, backward by data and update are each other's
  transposes), and whose fwd rule computes its residuals through themselves, never through
  a bare call: ``jax.grad`` of ``jax.grad`` (and higher) runs on the kernels. Forward mode
  (``jax.jvp``) is not supported.

``act`` is an activation code (``ACTIVATION_CODES``), static in every pass, and so is
``products``: 0 for exact products, or 1, 3 or 6 bfloat16 products of the float32 operands'
parts (``ops/emulation.py``'s method, split inside the call as the operands are re-blocked),
which the gradient passes use too.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _activations
from jax_brgemm._native import ACTIVATION_CODES
from jax_brgemm.ops import partitioning

__all__ = ["ACTIVATION_CODES", "GELU", "NONE", "activation_grad", "activation_grad_call",
           "backward_data", "backward_data_call", "forward", "forward_call", "preactivation_grad",
           "saved_for_backward", "weight_update", "weight_update_call"]

NONE, GELU = ACTIVATION_CODES["none"], ACTIVATION_CODES["gelu"]


# --- the custom calls --------------------------------------------------------------------
# vmap_method="expand_dims": under vmap every operand arrives with the batch dims in front
# (size 1 when unbatched); the handlers read unbatched operands in place and fold the batch
# into the mini-batch when the weights are shared.
# Each call is batch-partitionable: under jit with the rows of the mini-batch sharded, it
# runs per shard; the weight update's partial sums are psum'ed.


def _fwd_ffi(x, kernel, b, *, act, products):
    n, k = x.shape[0], kernel.shape[1]
    y = jax.ShapeDtypeStruct((n, k), x.dtype)
    z = jax.ShapeDtypeStruct((n, k) if act == GELU else (0,), x.dtype)
    return tuple(jax.ffi.ffi_call("jb_fc_fwd", (y, z), vmap_method="expand_dims")(
        x, kernel, b, act=np.int32(act), products=np.int64(products)))


def _act_grad_ffi(dy, saved, *, act):
    out = jax.ShapeDtypeStruct(dy.shape, dy.dtype)
    return tuple(jax.ffi.ffi_call("jb_fc_act_grad", (out,), vmap_method="expand_dims")(
        dy, saved, act=np.int32(act)))


def _bwd_ffi(dz, kernel, *, products):
    out = jax.ShapeDtypeStruct((dz.shape[0], kernel.shape[0]), dz.dtype)
    return tuple(jax.ffi.ffi_call("jb_fc_bwd", (out,), vmap_method="expand_dims")(
        dz, kernel, products=np.int64(products)))


def _upd_ffi(x, dz, *, w_shape, w_dtype, with_bias, products):
    dw = jax.ShapeDtypeStruct(w_shape, w_dtype)
    db = jax.ShapeDtypeStruct((w_shape[1] if with_bias else 0,), jnp.float32)
    return tuple(jax.ffi.ffi_call("jb_fc_upd", (dw, db), vmap_method="expand_dims")(
        x, dz, products=np.int64(products)))


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


def forward_call(x, kernel, bias, act, products=0):
    """``(y, z)``: ``act(x @ kernel + bias)`` and, for gelu, the pre-activation (else empty)."""
    b = jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    return _fwd_target(act, products)(x, kernel, b)


def activation_grad_call(dy, saved, act):
    """``dy * act'(saved)``."""
    return _act_grad_target(act)(dy, saved)[0]


def backward_data_call(dz, kernel, products=0):
    """``dz @ kernel.T``; ``dz`` may have more columns than kernel (its first K are used)."""
    return _bwd_target(products)(dz, kernel)[0]


def weight_update_call(x, dz, w_shape, w_dtype, with_bias, products=0):
    """``(x.T @ dz, the column sums of dz)`` over w_shape's C first columns of x and K of dz:
    the first in ``w_dtype``, the second float32 (empty without ``with_bias``)."""
    return _upd_target(tuple(w_shape), np.dtype(w_dtype), with_bias, products)(x, dz)


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


# --- the differentiable passes -------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def forward(x, kernel, bias, act, products=0):
    """(y, z) = (act(x @ kernel + bias), the pre-activation for gelu or an empty array)."""
    return forward_call(x, kernel, bias, act, products)


def _forward_fwd(x, kernel, bias, act, products):
    y, z = forward(x, kernel, bias, act, products)
    return (y, z), (x, kernel, bias, saved_for_backward(act, y, z))


def _forward_bwd(act, products, res, cotangents):
    x, kernel, bias, saved = res
    gy, gz = cotangents
    w_shape, w_dtype, with_bias = kernel.shape, np.dtype(kernel.dtype), bias is not None
    # dz once, read by both passes (applying act' inside each pass measured no faster)
    dz = preactivation_grad(act, gy.astype(x.dtype), gz, saved)
    dx = backward_data(dz, kernel, products)
    dw, db = weight_update(x, dz, w_shape, w_dtype, with_bias, products)
    return dx, dw, None if bias is None else db.astype(bias.dtype)


forward.defvjp(_forward_fwd, _forward_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def activation_grad(dy, saved, act):
    """dz = dy * act'(saved)."""
    return activation_grad_call(dy, saved, act)


def _activation_grad_fwd(dy, saved, act):
    return activation_grad(dy, saved, act), (dy, saved)


def _activation_grad_bwd(act, res, g):
    dy, saved = res
    name = _activations.name_of(act)
    # d/d saved of dy * f'(saved), in jnp (f'' is cheap, element-wise, and differentiable)
    _, vjp = jax.vjp(lambda s: dy.astype(jnp.float32) * _activations.derivative(name, s), saved)
    (d_saved,) = vjp(g.astype(jnp.float32))
    return activation_grad(g, saved, act), d_saved.astype(saved.dtype)


activation_grad.defvjp(_activation_grad_fwd, _activation_grad_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def backward_data(dz, kernel, products=0):
    """dx = dz @ kernel.T."""
    return backward_data_call(dz, kernel, products)


def _backward_data_fwd(dz, kernel, products):
    return backward_data(dz, kernel, products), (dz, kernel)


def _backward_data_bwd(products, res, g):
    dz, kernel = res
    g = g.astype(dz.dtype)
    d_dz, _ = forward(g, kernel, None, NONE, products)
    d_kernel, _ = weight_update(g, dz, kernel.shape, np.dtype(kernel.dtype), False, products)
    return d_dz, d_kernel


backward_data.defvjp(_backward_data_fwd, _backward_data_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def weight_update(x, dz, w_shape, w_dtype, with_bias, products=0):
    """(dkernel, dbias) = (x.T @ dz in w_dtype, the column sums of dz in float32 or empty)."""
    return weight_update_call(x, dz, w_shape, w_dtype, with_bias, products)


def _weight_update_fwd(x, dz, w_shape, w_dtype, with_bias, products):
    return weight_update(x, dz, w_shape, w_dtype, with_bias, products), (x, dz)


def _weight_update_bwd(w_shape, w_dtype, with_bias, products, res, cotangents):
    x, dz = res
    g_w, g_b = cotangents
    d_x = backward_data(dz, g_w, products)
    d_dz, _ = forward(x, g_w, g_b if with_bias else None, NONE, products)
    return d_x, d_dz.astype(dz.dtype)


weight_update.defvjp(_weight_update_fwd, _weight_update_bwd)
