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

The backward is split in separate calls on purpose: when ``dx`` is not needed (the first
layer of a network) XLA drops its call, and with it a third of the layer's backward work.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _native  # noqa: F401  (registers the FFI targets)

# Codes of jb::Activation (cpp/brgemm/brgemm.h).
ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2, "sigmoid": 3, "tanh": 4}
_NONE, _RELU, _GELU = 0, 1, 2

_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def dense(x, kernel, bias=None, *, activation=None, dtype=None):
    """Fully-connected layer: ``activation(x @ kernel + bias)`` on the BRGEMM kernels.

    Args:
      x: ``(..., C)`` float32 or bfloat16. Leading dims are folded into the mini-batch.
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
    """
    x = _as_array(x, "x")
    kernel = _as_array(kernel, "kernel")
    if bias is not None:
        bias = _as_array(bias, "bias")
    act = _activation_code(activation)
    if x.ndim < 1:
        raise ValueError(f"dense: x must have rank >= 1 (..., C), got a scalar of shape {x.shape}")
    if kernel.ndim != 2:
        raise ValueError(f"dense: kernel must be (C, K), got shape {kernel.shape}")
    c, k = kernel.shape
    if x.shape[-1] != c:
        raise ValueError(f"dense: x {x.shape} has {x.shape[-1]} features but kernel {kernel.shape} "
                         f"expects C = {c}")
    if bias is not None and bias.shape != (k,):
        raise ValueError(f"dense: bias must have shape (K,) = ({k},), got {bias.shape}")
    zero = {"C": c, "K": k, **{f"x.shape[{i}]": d for i, d in enumerate(x.shape[:-1])}}
    zero = {name: d for name, d in zero.items() if d < 1}
    if zero:
        raise ValueError("dense: sizes must be >= 1, got " +
                         ", ".join(f"{name}={d}" for name, d in zero.items()))
    if dtype is None:
        dtype = jnp.result_type(*(a for a in (x, kernel, bias) if a is not None))
    dtype = np.dtype(dtype)
    if dtype not in _DTYPES:
        raise TypeError(f"dense: the computation dtype must be float32 or bfloat16, got {dtype}")

    lead = x.shape[:-1]
    x2 = x.astype(dtype).reshape((-1, c))
    y = _dense(x2, kernel, bias, act)
    return y.reshape(lead + (k,))


def _as_array(a, name):
    if not hasattr(a, "dtype"):
        a = jnp.asarray(a, dtype=jnp.float32)
    if np.dtype(a.dtype) not in _DTYPES:
        raise TypeError(f"dense: {name} must be float32 or bfloat16, got {a.dtype}")
    return jnp.asarray(a)


def _activation_code(activation):
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"dense: activation must be None or one of "
                        f"{sorted(a for a in ACTIVATIONS if a)}, got {activation!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"dense: unknown activation {activation!r}; expected None or one of "
                         f"{sorted(a for a in ACTIVATIONS if a)}")
    return ACTIVATIONS[activation]


# --- the custom calls --------------------------------------------------------------------
# vmap_method="expand_dims": under vmap every operand arrives with the batch dims in
# front (size 1 when unbatched); the handlers read unbatched operands in place and fold
# the batch into the mini-batch when the weights are shared.


def _forward(x, kernel, bias, act):
    n, k = x.shape[0], kernel.shape[1]
    b = jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    y = jax.ShapeDtypeStruct((n, k), x.dtype)
    z = jax.ShapeDtypeStruct((n, k) if act == _GELU else (0,), x.dtype)
    return jax.ffi.ffi_call("jb_fc_fwd", (y, z), vmap_method="expand_dims")(
        x, kernel, b, act=np.int32(act))


def _act_grad(dy, saved, act):
    out = jax.ShapeDtypeStruct(dy.shape, dy.dtype)
    return jax.ffi.ffi_call("jb_fc_act_grad", out, vmap_method="expand_dims")(
        dy, saved, act=np.int32(act))


def _backward(dz, kernel, x_shape):
    out = jax.ShapeDtypeStruct(x_shape, dz.dtype)
    return jax.ffi.ffi_call("jb_fc_bwd", out, vmap_method="expand_dims")(dz, kernel)


def _update(x, dz, kernel, with_bias):
    dw = jax.ShapeDtypeStruct(kernel.shape, kernel.dtype)
    db = jax.ShapeDtypeStruct((kernel.shape[1] if with_bias else 0,), jnp.float32)
    return jax.ffi.ffi_call("jb_fc_upd", (dw, db), vmap_method="expand_dims")(x, dz)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x, kernel, bias, act):
    return _forward(x, kernel, bias, act)[0]


def _dense_fwd(x, kernel, bias, act):
    y, z = _forward(x, kernel, bias, act)
    saved = None if act == _NONE else z if act == _GELU else y
    return y, (x, kernel, bias, saved)


def _dense_bwd(act, res, g):
    x, kernel, bias, saved = res
    g = g.astype(x.dtype)
    dz = g if act == _NONE else _act_grad(g, saved, act)
    dx = _backward(dz, kernel, x.shape)
    dw, db = _update(x, dz, kernel, bias is not None)
    return dx, dw, None if bias is None else db.astype(bias.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)
