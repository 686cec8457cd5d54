"""jb.lstm: a whole LSTM sequence as BRGEMM custom calls with a custom VJP.

The paper's fused data-flow LSTM (§3.1, Algorithm 2) in ``cpp/layers/lstm``:

* ``jb_lstm_fwd``: the forward over all time steps in one call. The weights are re-blocked
  once; per step, every (N-block, K-block) tile computes its four gate blocks with BRGEMM
  (sigmoid / tanh in the kernel's epilogue) and the cell update while they are hot. For
  training it also saves the activated gates and the cell states (float32).
* ``jb_lstm_bptt``: backward through time, one call: per step the recurrent gradient
  ``da_{t+1} @ R^T`` by BRGEMM, fused with the gate derivatives. It returns every step's
  gate gradient ``da``, the bias gradient and the initial carry's gradients.
* The remaining gradients are three big fully-connected passes over all steps at once
  (``cpp/layers/fc``): ``dx = da @ kernel_i.T``, ``dkernel_i = x.T @ da`` and
  ``dkernel_h = h_prev.T @ da``. XLA drops the ones nobody needs (e.g. ``dx`` of a first
  layer).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _native  # noqa: F401  (registers the FFI targets)
from jax_brgemm.ops.dense import _bwd_call, _upd_call

_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
# jb::lstm::Variant: 0 lets the layer choose (fused or precompute, by shape).
_AUTOMATIC = 0


def lstm(x, kernel_i, kernel_h, bias, *, initial_carry=None, time_major=False, dtype=None):
    """An LSTM over a whole sequence on the BRGEMM kernels.

    Gate order (i, f, g, o) as ``flax.linen.OptimizedLSTMCell``::

      i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of (x_t @ kernel_i + h @ kernel_h + bias)
      c' = f * c + i * g,  h' = o * tanh(c')

    Args:
      x: ``(N, T, C)``, or ``(T, N, C)`` with ``time_major``; float32 or bfloat16.
      kernel_i: ``(C, 4K)``, the input kernels of the gates i, f, g, o side by side.
      kernel_h: ``(K, 4K)``, the recurrent kernels.
      bias: ``(4K,)``.
      initial_carry: ``(c0, h0)``, each ``(N, K)``; zeros when None.
      time_major: whether ``x`` (and the output) is time-major.
      dtype: the computation dtype, float32 or bfloat16; ``None`` promotes the dtypes of
        ``x`` and the kernels. Multiplies run in it (bfloat16: float32 accumulation); the
        cell state and all element-wise math are float32.

    Returns:
      ``(carry, y)``: ``carry = (c_T, h_T)`` with ``c_T`` float32 and ``h_T`` ``(N, K)`` in
      the computation dtype, and ``y`` every ``h_t``, shaped like ``x`` with K features.
      Differentiable in ``x``, both kernels, the bias and the initial carry, from ``y`` and
      from the final carry.
    """
    x = _as_array(x, "x")
    kernel_i = _as_array(kernel_i, "kernel_i")
    kernel_h = _as_array(kernel_h, "kernel_h")
    bias = _as_array(bias, "bias")
    if x.ndim != 3:
        layout = "(T, N, C)" if time_major else "(N, T, C)"
        raise ValueError(f"lstm: x must have rank 3 {layout}, got shape {x.shape}")
    if kernel_h.ndim != 2 or kernel_h.shape[1] != 4 * kernel_h.shape[0]:
        raise ValueError(f"lstm: kernel_h must be (K, 4K), got shape {kernel_h.shape}")
    k = kernel_h.shape[0]
    t, n, c = (x.shape if time_major else (x.shape[1], x.shape[0], x.shape[2]))
    if k < 1:
        raise ValueError(f"lstm: the hidden size K must be >= 1, got kernel_h {kernel_h.shape}")
    if c < 1:
        raise ValueError(f"lstm: x {x.shape} has no features (C = 0)")
    if kernel_i.shape != (c, 4 * k):
        raise ValueError(f"lstm: kernel_i must be (C, 4K) = ({c}, {4 * k}) for x {x.shape} and "
                         f"kernel_h {kernel_h.shape}, got {kernel_i.shape}")
    if bias.shape != (4 * k,):
        raise ValueError(f"lstm: bias must be (4K,) = ({4 * k},), got {bias.shape}")
    if dtype is None:
        dtype = jnp.result_type(x, kernel_i, kernel_h)
    dtype = np.dtype(dtype)
    if dtype not in _DTYPES:
        raise TypeError(f"lstm: the computation dtype must be float32 or bfloat16, got {dtype}")
    x = x.astype(dtype)
    # The kernels go in as they are (cast while re-blocked) when both share a dtype.
    wdt = jnp.result_type(kernel_i, kernel_h)
    kernel_i, kernel_h = kernel_i.astype(wdt), kernel_h.astype(wdt)
    bias = bias.astype(jnp.float32)

    if initial_carry is None:
        c0 = jnp.zeros((n, k), jnp.float32)
        h0 = jnp.zeros((n, k), dtype)
    else:
        if not isinstance(initial_carry, (tuple, list)) or len(initial_carry) != 2:
            raise ValueError("lstm: initial_carry must be a pair (c0, h0) of (N, K) arrays")
        c0, h0 = initial_carry
        c0 = _as_array(c0, "initial_carry[0] (c0)", any_float=True)
        h0 = _as_array(h0, "initial_carry[1] (h0)", any_float=True)
        for name, a in (("c0", c0), ("h0", h0)):
            if a.shape != (n, k):
                raise ValueError(f"lstm: initial carry {name} must be (N, K) = ({n}, {k}), got {a.shape}")
        c0 = c0.astype(jnp.float32)
        h0 = h0.astype(dtype)

    if n == 0 or t == 0:  # nothing to run: an empty output, the carry passes through
        y = jnp.zeros(((t, n, k) if time_major else (n, t, k)), dtype)
        return (c0, h0), y
    (c_t, h_t), y = _lstm(x, kernel_i, kernel_h, bias, c0, h0, bool(time_major))
    return (c_t, h_t), y


def _as_array(a, name, any_float=False):
    if not hasattr(a, "dtype"):
        a = jnp.asarray(a, dtype=jnp.float32)
    dt = np.dtype(a.dtype)
    if dt not in _DTYPES and not (any_float and jnp.issubdtype(dt, jnp.floating)):
        raise TypeError(f"lstm: {name} must be float32 or bfloat16, got {a.dtype}")
    return jnp.asarray(a)


# --- the custom calls --------------------------------------------------------------------
# vmap runs them one mapped element at a time (vmap_method="sequential").


def _forward(x, wi, wh, b, c0, h0, time_major, save):
    t, n = (x.shape[0], x.shape[1]) if time_major else (x.shape[1], x.shape[0])
    k = wh.shape[0]
    y = jax.ShapeDtypeStruct(x.shape[:2] + (k,), x.dtype)
    carry = (jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), x.dtype))
    gates = jax.ShapeDtypeStruct((t, n, 4 * k) if save else (0,), jnp.float32)
    cs = jax.ShapeDtypeStruct((t, n, k) if save else (0,), jnp.float32)
    return jax.ffi.ffi_call("jb_lstm_fwd", (y, *carry, gates, cs), vmap_method="sequential")(
        x, wi, wh, b, c0, h0, time_major=time_major, variant=np.int32(_AUTOMATIC))


def _bptt(wh, gates, cs, c0, dy, dc_t, dh_t, time_major):
    n, k = c0.shape
    da = jax.ShapeDtypeStruct(dy.shape[:2] + (4 * k,), dy.dtype)
    outs = (da, jax.ShapeDtypeStruct((4 * k,), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.float32),
            jax.ShapeDtypeStruct((n, k), dy.dtype))
    return jax.ffi.ffi_call("jb_lstm_bptt", outs, vmap_method="sequential")(
        wh, gates, cs, c0, dy, dc_t, dh_t, time_major=time_major)


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _lstm(x, wi, wh, b, c0, h0, time_major):
    y, c_t, h_t, _, _ = _forward(x, wi, wh, b, c0, h0, time_major, save=False)
    return (c_t, h_t), y


def _lstm_fwd(x, wi, wh, b, c0, h0, time_major):
    y, c_t, h_t, gates, cs = _forward(x, wi, wh, b, c0, h0, time_major, save=True)
    return ((c_t, h_t), y), (x, wi, wh, gates, cs, c0, h0, y)


def _lstm_bwd(time_major, res, g):
    x, wi, wh, gates, cs, c0, h0, y = res
    (dc_t, dh_t), dy = g
    dt = x.dtype
    da, db, dc0, dh0 = _bptt(wh, gates, cs, c0, dy.astype(dt), dc_t.astype(jnp.float32),
                             dh_t.astype(dt), time_major)
    c, k = wi.shape[0], wh.shape[0]
    rows = x.shape[0] * x.shape[1]
    da2 = da.reshape(rows, 4 * k)
    dx = _bwd_call(da2, wi).reshape(x.shape)
    dwi = _upd_call(x.reshape(rows, c), da2, wi.shape, wi.dtype, False)[0]
    # h_{t-1} for every step, in x's row order.
    t_axis = 0 if time_major else 1
    h_prev = jnp.concatenate([jnp.expand_dims(h0, t_axis),
                              jax.lax.slice_in_dim(y, 0, y.shape[t_axis] - 1, axis=t_axis)], axis=t_axis)
    dwh = _upd_call(h_prev.reshape(rows, k), da2, wh.shape, wh.dtype, False)[0]
    return dx, dwi, dwh, db, dc0, dh0


_lstm.defvjp(_lstm_fwd, _lstm_bwd)
