"""jb.dense: a fully-connected layer as fused BRGEMM custom calls with a custom VJP.

Forward, backward-by-data and weight update are each one XLA FFI call into
``cpp/layers/fc`` (the paper's Algorithm 5 and its two dual passes):

* ``jb_fc_fwd``: ``y = act(x @ kernel + bias)``, bias and activation fused into the kernel's
  epilogue. The kernel is re-blocked (and cast to the compute dtype) inside the call.
* ``jb_fc_act_grad``: ``dz = dy * act'(saved)``, element-wise, from what the forward saved:
  the output ``y`` for relu, sigmoid and tanh (no extra memory: it is the result), the
  pre-activation ``z`` for gelu.
* ``jb_fc_bwd``: ``dx = dz @ kernel.T``.
* ``jb_fc_upd``: ``dkernel = x.T @ dz`` and ``dbias = sum(dz)``, race-free.
* ``jb_fc_upd_sgd``: the same gradients applied at once by SGD with momentum to the
  parameters and their momenta, in place (``sgd_update`` below; the training harness's
  fused optimizer step).

``dz`` is computed once and read by both backward passes. (Applying ``act'`` inside each
of them instead, while they read ``dz``, measured no faster inside a training step: equal in
fp32, 4-8 % slower in bf16, since both passes then recompute it.)

The backward is split in separate calls on purpose: when ``dx`` is not needed (the first
layer of a network) XLA drops its call, and with it a third of the layer's backward work.

Every one of the four calls is a ``custom_vjp`` function whose backward is made of the
others (the backward of a linear pass is a linear pass: ``fwd``, ``bwd`` and ``upd`` are
each other's transposes), and every fwd rule produces its residuals through those functions,
never through a bare ``ffi_call``: ``jax.grad`` of ``jax.grad`` (and higher) runs on the
kernels. Forward mode (``jax.jvp``, ``jacfwd``, ``hessian``) is not supported: JAX raises
its "can't apply forward-mode autodiff (jvp) to a custom_vjp function".
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm._native import ACTIVATION_CODES
from jax_brgemm.ops import partitioning

_NONE, _GELU = ACTIVATION_CODES["none"], ACTIVATION_CODES["gelu"]


def dense(x, kernel, bias=None, *, activation=None, dtype=None):
    """Fully-connected layer: ``activation(x @ kernel + bias)`` on the BRGEMM kernels.

    Args:
      x: ``(..., C)`` float32 or bfloat16. Leading dims are folded into the mini-batch; a
        leading dim of size 0 (an empty batch) gives an empty result.
      kernel: ``(C, K)`` float32 or bfloat16 (Flax's ``Dense`` kernel layout).
      bias: optional ``(K,)`` float32 or bfloat16.
      activation: ``None``, ``"relu"``, ``"gelu"`` (tanh approximation, like
        ``flax.linen.gelu``), ``"sigmoid"`` or ``"tanh"``; fused into the kernel.
      dtype: the computation dtype, float32 or bfloat16. ``None`` promotes the arguments'
        dtypes like ``flax.linen.dtypes.promote_dtype``. ``x`` and ``kernel`` are used in
        this dtype (the kernel is cast while it is re-blocked, inside the call);
        accumulation, bias and activation are always float32.

    Returns:
      ``(..., K)`` in ``dtype``. Gradients come back in each argument's own dtype; with a
      float32 kernel and bfloat16 compute, the kernel gradient is accumulated and returned
      in float32 without a bfloat16 rounding in between.

    Sizes of 0 (no rows, C = 0 or K = 0) compute what ``x @ kernel + bias`` computes, in
    XLA: an empty result, or for C = 0 the activation of the bias.
    """
    op = "jb.dense"
    x = check.array(x, "x", op)
    kernel = check.array(kernel, "kernel", op)
    if bias is not None:
        bias = check.array(bias, "bias", op)
    act = check.activation(activation, op)
    check.rank(x, "x", op, "(..., C)", at_least=1)
    check.rank(kernel, "kernel", op, "(C, K)", exactly=2)
    c, k = kernel.shape
    if x.shape[-1] != c:
        raise ValueError(f"{op}: x {x.shape} has {x.shape[-1]} features but kernel "
                         f"{kernel.shape} expects C = {c}")
    if bias is not None:
        check.shape(bias, "bias", op, (k,), "(K,)")
    dtype = check.compute_dtype(op, dtype, x, kernel, bias)

    lead = x.shape[:-1]
    if x.size == 0 or kernel.size == 0:
        return _dense_xla(x, kernel, bias, activation, dtype)
    x2 = x.astype(dtype).reshape((-1, c))
    y, _ = _fc(x2, kernel, bias, act)
    return y.reshape(lead + (k,))


def _dense_xla(x, kernel, bias, activation, dtype):
    """What the kernels compute, in XLA: for sizes the kernels do not take (0)."""
    y = jnp.matmul(x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return _activations.apply(activation, y).astype(dtype)


# --- the custom calls --------------------------------------------------------------------
# All on 2-D operands. vmap_method="expand_dims": under vmap every operand arrives with the
# batch dims in front (size 1 when unbatched); the handlers read unbatched operands in
# place and fold the batch into the mini-batch when the weights are shared.
# Each call is batch-partitionable (partitioning.rows): under jit with the rows of the
# mini-batch sharded, it runs per shard; the weight update's partial sums are psum'ed.


def _fc_ffi(x, kernel, b, *, act):
    n, k = x.shape[0], kernel.shape[1]
    y = jax.ShapeDtypeStruct((n, k), x.dtype)
    z = jax.ShapeDtypeStruct((n, k) if act == _GELU else (0,), x.dtype)
    return tuple(jax.ffi.ffi_call("jb_fc_fwd", (y, z), vmap_method="expand_dims")(
        x, kernel, b, act=np.int32(act)))


def _act_grad_ffi(dy, saved, *, act):
    out = jax.ShapeDtypeStruct(dy.shape, dy.dtype)
    return tuple(jax.ffi.ffi_call("jb_fc_act_grad", (out,), vmap_method="expand_dims")(
        dy, saved, act=np.int32(act)))


def _bwd_ffi(dz, kernel):
    out = jax.ShapeDtypeStruct((dz.shape[0], kernel.shape[0]), dz.dtype)
    return tuple(jax.ffi.ffi_call("jb_fc_bwd", (out,), vmap_method="expand_dims")(dz, kernel))


def _upd_ffi(x, dz, *, w_shape, w_dtype, with_bias):
    dw = jax.ShapeDtypeStruct(w_shape, w_dtype)
    db = jax.ShapeDtypeStruct((w_shape[1] if with_bias else 0,), jnp.float32)
    return tuple(jax.ffi.ffi_call("jb_fc_upd", (dw, db), vmap_method="expand_dims")(x, dz))


def sgd_update(x, dz, kernel, kernel_trace, bias, bias_trace, lr, *, momentum, nesterov,
               weight_decay, after=None):
    """One step of optax's ``chain(add_decayed_weights(weight_decay, <kernels>),
    sgd(lr, momentum, nesterov))`` for a dense layer whose gradients are ``x.T @ dz`` and
    ``sum(dz, 0)``, without forming them: the weight update computes each block of the
    kernel's gradient and applies it while it is in cache.

    ``x`` (N, C) and ``dz`` (N, K) in the layer's computation dtype (float32 or bfloat16);
    the parameters ``kernel`` (C, K), ``bias`` (K,) or None and their momenta (optax's
    ``TraceState.trace`` leaves) float32; ``lr`` the step's learning rate (a scalar).
    Returns the new ``(kernel, kernel_trace, bias, bias_trace)`` (bias ones None without a
    bias); the four buffers are updated in place when the caller donates them. Not
    differentiable. Weight decay applies to the kernel only (``optim.kernel_mask``).

    ``after``: an array the update waits for and does not read. The kernel is rewritten in
    place, so XLA copies it first unless every other reader of it is known to come before;
    pass the result of the layer's backward pass (``dz @ kernel.T``, or what depends on it).
    """
    if x.ndim != 2 or dz.ndim != 2 or kernel.shape != (x.shape[1], dz.shape[1]):
        raise ValueError(f"sgd_update: x {x.shape}, dz {dz.shape} and kernel {kernel.shape} "
                         "must be (N, C), (N, K) and (C, K)")
    if x.dtype != dz.dtype or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"sgd_update: x and dz must share float32 or bfloat16, got {x.dtype}, {dz.dtype}")
    if (bias is None) != (bias_trace is None):
        raise ValueError("sgd_update: give the bias and its trace together, or neither")
    f32 = [a for a in (kernel, kernel_trace, bias, bias_trace) if a is not None]
    if any(a.dtype != jnp.float32 for a in f32) or kernel_trace.shape != kernel.shape or (
            bias is not None and (bias.shape != (kernel.shape[1],) or bias_trace.shape != bias.shape)):
        raise ValueError("sgd_update: kernel, bias and their traces must be float32, the traces "
                         "of their parameters' shapes, the bias (K,)")
    empty = jnp.zeros((0,), jnp.float32)
    b, mb = (empty, empty) if bias is None else (bias, bias_trace)
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (kernel, kernel_trace, b, mb))
    kernel, kernel_trace, b, mb = jax.ffi.ffi_call(
        "jb_fc_upd_sgd", outs, input_output_aliases={2: 0, 3: 1, 4: 2, 5: 3})(
        x, dz, kernel, kernel_trace, b, mb, jnp.asarray(lr, jnp.float32),
        empty if after is None else after, momentum=np.float32(momentum), weight_decay=np.float32(weight_decay),
        nesterov=bool(nesterov))
    return kernel, kernel_trace, (None if bias is None else b), (None if bias is None else mb)


def act_grad(dy, y, activation):
    """``dy * activation'(.)`` from the layer's output ``y`` (the activations whose derivative
    is a function of the output: None, relu, sigmoid, tanh)."""
    act = ACTIVATION_CODES[activation or "none"]
    if act == _GELU:
        raise ValueError("act_grad: gelu's derivative is not a function of its output")
    return dy if act == _NONE else _act_grad_call(dy, y, act)


_R, _SUM = partitioning.ROWS, partitioning.SUM


@partitioning.cached
def _fc_target(act):
    return partitioning.rows(partial(_fc_ffi, act=act), (_R, None, None), (_R, _R))


@partitioning.cached
def _act_grad_target(act):
    return partitioning.rows(partial(_act_grad_ffi, act=act), (_R, _R), (_R,))


@partitioning.cached
def _bwd_target():
    return partitioning.rows(_bwd_ffi, (_R, None), (_R,))


@partitioning.cached
def _upd_target(w_shape, w_dtype, with_bias):
    return partitioning.rows(partial(_upd_ffi, w_shape=w_shape, w_dtype=w_dtype,
                                     with_bias=with_bias), (_R, _R), (_SUM, _SUM))


def _fc_call(x, kernel, bias, act):
    b = jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    return _fc_target(act)(x, kernel, b)


def _act_grad_call(dy, saved, act):
    return _act_grad_target(act)(dy, saved)[0]


def _bwd_call(dz, kernel):
    """dx = dz @ kernel.T; dz may have more columns than kernel (its first K are used)."""
    return _bwd_target()(dz, kernel)[0]


def _upd_call(x, dz, w_shape, w_dtype, with_bias):
    """(x.T @ dz, the column sums of dz) over w_shape's C first columns of x and K of dz."""
    return _upd_target(tuple(w_shape), np.dtype(w_dtype), with_bias)(x, dz)


# --- the differentiable passes -------------------------------------------------------------
# Each is a custom_vjp function whose bwd calls the others, and whose fwd computes its
# outputs by calling itself, so that an outer differentiation (grad of grad) sees only
# differentiable functions.


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fc(x, kernel, bias, act):
    """(y, z) = (act(x @ kernel + bias), the pre-activation for gelu or an empty array)."""
    return _fc_call(x, kernel, bias, act)


def _fc_fwd(x, kernel, bias, act):
    y, z = _fc(x, kernel, bias, act)
    saved = None if act == _NONE else z if act == _GELU else y
    return (y, z), (x, kernel, bias, saved)


def _fc_bwd(act, res, cotangents):
    x, kernel, bias, saved = res
    gy, gz = cotangents
    gy = gy.astype(x.dtype)
    w_shape, w_dtype, with_bias = kernel.shape, np.dtype(kernel.dtype), bias is not None
    # dz once, read by both passes (applying act' inside each pass measured no faster)
    dz = gy if act == _NONE else _act_grad(gy, saved, act)
    if act == _GELU:
        dz = dz + gz.astype(gy.dtype)  # z is an output too
    dx = _fc_bwd_pass(dz, kernel)
    dw, db = _fc_upd(x, dz, w_shape, w_dtype, with_bias)
    return dx, dw, None if bias is None else db.astype(bias.dtype)


_fc.defvjp(_fc_fwd, _fc_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _act_grad(dy, saved, act):
    """dz = dy * act'(saved)."""
    return _act_grad_call(dy, saved, act)


def _act_grad_fwd(dy, saved, act):
    return _act_grad(dy, saved, act), (dy, saved)


def _act_grad_bwd(act, res, g):
    dy, saved = res
    name = _activations.NAMES[act]
    # d/d saved of dy * f'(saved), in jnp (f'' is cheap, element-wise, and differentiable)
    _, vjp = jax.vjp(lambda s: dy.astype(jnp.float32) * _activations.derivative(name, s), saved)
    (d_saved,) = vjp(g.astype(jnp.float32))
    return _act_grad(g, saved, act), d_saved.astype(saved.dtype)


_act_grad.defvjp(_act_grad_fwd, _act_grad_bwd)


@jax.custom_vjp
def _fc_bwd_pass(dz, kernel):
    """dx = dz @ kernel.T."""
    return _bwd_call(dz, kernel)


def _fc_bwd_pass_fwd(dz, kernel):
    return _fc_bwd_pass(dz, kernel), (dz, kernel)


def _fc_bwd_pass_bwd(res, g):
    dz, kernel = res
    g = g.astype(dz.dtype)
    d_dz, _ = _fc(g, kernel, None, _NONE)
    d_kernel, _ = _fc_upd(g, dz, kernel.shape, np.dtype(kernel.dtype), False)
    return d_dz, d_kernel


_fc_bwd_pass.defvjp(_fc_bwd_pass_fwd, _fc_bwd_pass_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fc_upd(x, dz, w_shape, w_dtype, with_bias):
    """(dkernel, dbias) = (x.T @ dz in w_dtype, the column sums of dz in float32 or empty)."""
    return _upd_call(x, dz, w_shape, w_dtype, with_bias)


def _fc_upd_fwd(x, dz, w_shape, w_dtype, with_bias):
    return _fc_upd(x, dz, w_shape, w_dtype, with_bias), (x, dz)


def _fc_upd_bwd(w_shape, w_dtype, with_bias, res, cotangents):
    x, dz = res
    g_w, g_b = cotangents
    d_x = _fc_bwd_pass(dz, g_w)
    d_dz, _ = _fc(x, g_w, g_b if with_bias else None, _NONE)
    return d_x, d_dz.astype(dz.dtype)


_fc_upd.defvjp(_fc_upd_fwd, _fc_upd_bwd)
