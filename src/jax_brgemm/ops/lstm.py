"""jb.lstm: a whole LSTM sequence as BRGEMM custom calls with a custom VJP.

The paper's fused data-flow LSTM (§3.1, Algorithm 2) in ``cpp/layers/lstm``:

* ``jb_lstm_fwd``: the forward over all time steps in one call. The weights are re-blocked
  once; per step, every (N-block, K-block) tile computes its four gate blocks with BRGEMM
  over ``[x_t | h_{t-1}]`` (sigmoid / tanh in the kernel's epilogue) and the cell update
  while they are hot. For training it also saves the activated gates (in the computation
  dtype) and the cell states (float32), and keeps the buffer the steps multiplied,
  ``xh = [x | h_prev]``.
* ``jb_lstm_bptt``: backward through time, one call: per step the recurrent gradient
  ``da_{t+1} @ R^T`` by BRGEMM, fused with the gate derivatives. It returns every step's
  gate gradient ``da`` (rows padded past 4K columns, away from a 4 KiB period, so that the
  passes after it read it in place), the bias gradient and the initial carry's gradients.
* The remaining gradients are two big fully-connected passes over all steps at once
  (``ops/fc_passes.py``): ``dx = da @ kernel_i.T`` and the weight update of both kernels in one
  pass over the saved ``xh``, ``[dkernel_i; dkernel_h] = xh.T @ da`` (reduction over every
  step and row, ``da`` read once). XLA drops the ones nobody needs (e.g. ``dx`` of a first
  layer).

Under ``vmap`` with shared weights the mapped axis is folded into the mini-batch (one call of
each kind for the whole map); mapped weights run one element at a time (``lax.map``).
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _native  # registers the FFI targets
from jax_brgemm import _validate as check
from jax_brgemm.ops import fc_passes

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
    op = "jb.lstm"
    x = check.array(x, "x", op)
    kernel_i = check.array(kernel_i, "kernel_i", op)
    kernel_h = check.array(kernel_h, "kernel_h", op)
    bias = check.array(bias, "bias", op)
    check.rank(x, "x", op, "(T, N, C)" if time_major else "(N, T, C)", exactly=3)
    check.rank(kernel_h, "kernel_h", op, "(K, 4K)", exactly=2)
    k = kernel_h.shape[0]
    if k < 1 or kernel_h.shape[1] != 4 * k:
        raise ValueError(f"{op}: kernel_h must be (K, 4K) with K >= 1, got shape {kernel_h.shape}")
    t, n, c = (x.shape if time_major else (x.shape[1], x.shape[0], x.shape[2]))
    if c < 1:
        raise ValueError(f"{op}: x {x.shape} has no features (C = 0)")
    check.rank(kernel_i, "kernel_i", op, "(C, 4K)", exactly=2)
    check.shape(kernel_i, "kernel_i", op, (c, 4 * k), "(C, 4K)")
    check.shape(bias, "bias", op, (4 * k,), "(4K,)")
    dtype = check.compute_dtype(op, dtype, x, kernel_i, kernel_h)
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
            raise ValueError(f"{op}: initial_carry must be a pair (c0, h0) of (N, K) arrays")
        floats = (*check.KERNEL_DTYPES, np.dtype(np.float16), np.dtype(np.float64))
        c0 = check.array(initial_carry[0], "initial_carry[0] (c0)", op, floats)
        h0 = check.array(initial_carry[1], "initial_carry[1] (h0)", op, floats)
        check.shape(c0, "initial_carry[0] (c0)", op, (n, k), "(N, K)")
        check.shape(h0, "initial_carry[1] (h0)", op, (n, k), "(N, K)")
        c0 = c0.astype(jnp.float32)
        h0 = h0.astype(dtype)

    if n == 0 or t == 0:  # nothing to run: an empty output, the carry passes through
        y = jnp.zeros(((t, n, k) if time_major else (n, t, k)), dtype)
        return (c0, h0), y
    (c_t, h_t), y = _lstm(x, kernel_i, kernel_h, bias, c0, h0, bool(time_major))
    return (c_t, h_t), y


# --- the custom calls --------------------------------------------------------------------
# Under vmap with shared weights (the usual case: a batch of sequences through one layer)
# the mapped axis is folded into the mini-batch N, so the kernels see one larger call;
# mapped weights run one mapped element at a time (lax.map).


def _fold(a, batched, size, axis):
    """``a`` with its leading mapped axis (broadcast when unbatched) folded into N, which is
    axis ``axis`` of the unmapped array: (B, ..., N, ...) -> (..., B * N, ...)."""
    if not batched:
        a = jnp.broadcast_to(a, (size,) + a.shape)
    a = jnp.moveaxis(a, 0, axis)
    return a.reshape(a.shape[:axis] + (size * a.shape[axis + 1],) + a.shape[axis + 2:])


def _unfold(a, size, axis):
    """The inverse of ``_fold``: (..., B * N, ...) -> (B, ..., N, ...)."""
    a = a.reshape(a.shape[:axis] + (size, a.shape[axis] // size) + a.shape[axis + 1:])
    return jnp.moveaxis(a, axis, 0)


# N's axis in the saved gates (T, K-blocks, N, 4 x block) and cell states (T, N, K).
_GATES_N, _CS_N = 2, 1


def _sequential(fn, args, in_batched, size):
    """``fn`` once per mapped element (the unbatched arguments shared)."""
    idx = [i for i, b in enumerate(in_batched) if b]

    def one(batched_args):
        full = list(args)
        for i, a in zip(idx, batched_args):
            full[i] = a
        return fn(*full)

    return jax.lax.map(one, [args[i] for i in idx])


def forward_call(x, wi, wh, b, c0, h0, time_major, save):
    """The forward over every step, one call (not differentiable): ``(y, c_T, h_T, gates,
    cell states, xh)``, the last three empty unless ``save`` (what the backward reads)."""
    return _forward_vmappable(time_major, save)(x, wi, wh, b, c0, h0)


def _forward_ffi(x, wi, wh, b, c0, h0, time_major, save):
    t, n = (x.shape[0], x.shape[1]) if time_major else (x.shape[1], x.shape[0])
    k = wh.shape[0]
    y = jax.ShapeDtypeStruct(x.shape[:2] + (k,), x.dtype)
    carry = (jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), x.dtype))
    # The saved gates in the backward's K-blocks, each block's rows of four gates contiguous.
    shape = _native.lstm_saved_gates_shape(t, n, k, x.dtype == jnp.bfloat16)
    gates = jax.ShapeDtypeStruct(tuple(shape) if save else (0,), x.dtype)
    cs = jax.ShapeDtypeStruct((t, n, k) if save else (0,), jnp.float32)
    width = _native.lstm_saved_width(t, n, x.shape[2], k, x.dtype == jnp.bfloat16, time_major)
    xh = jax.ShapeDtypeStruct(x.shape[:2] + (width,) if save else (0,), x.dtype)
    return jax.ffi.ffi_call("jb_lstm_fwd", (y, *carry, gates, cs, xh), vmap_method="sequential")(
        x, wi, wh, b, c0, h0, time_major=time_major, variant=np.int32(_AUTOMATIC))


@lru_cache(maxsize=None)
def _forward_vmappable(time_major, save):
    call = partial(_forward_ffi, time_major=time_major, save=save)

    @jax.custom_batching.custom_vmap
    def fwd(x, wi, wh, b, c0, h0):
        return tuple(call(x, wi, wh, b, c0, h0))

    @fwd.def_vmap
    def fwd_vmap(size, in_batched, x, wi, wh, b, c0, h0):
        if any(in_batched[1:4]):
            outs = _sequential(fwd, (x, wi, wh, b, c0, h0), in_batched, size)
        else:
            xn = int(time_major)
            y, c_t, h_t, gates, cs, xh = call(_fold(x, in_batched[0], size, xn), wi, wh, b,
                                              _fold(c0, in_batched[4], size, 0),
                                              _fold(h0, in_batched[5], size, 0))
            outs = (_unfold(y, size, xn), _unfold(c_t, size, 0), _unfold(h_t, size, 0),
                    _unfold(gates, size, _GATES_N) if save else jnp.zeros((size, 0), gates.dtype),
                    _unfold(cs, size, _CS_N) if save else jnp.zeros((size, 0), cs.dtype),
                    _unfold(xh, size, xn) if save else jnp.zeros((size, 0), xh.dtype))
        return tuple(outs), (True,) * 6

    return fwd


def bptt_call(wh, gates, cs, c0, dy, dc_t, dh_t, time_major):
    """Backward through time, one call (not differentiable): ``(da, db, dc0, dh0)``, ``da``
    every step's gate gradient in rows padded past 4K columns."""
    return _bptt_vmappable(time_major)(wh, gates, cs, c0, dy, dc_t, dh_t)


def _bptt_ffi(wh, gates, cs, c0, dy, dc_t, dh_t, time_major):
    n, k = c0.shape
    t = dy.shape[0] if time_major else dy.shape[1]
    # da's rows are padded (the first 4K columns are the gradient) away from a 4 KiB
    # period, so that the fully-connected passes after bptt read them in place.
    width = _native.lstm_da_width(t, n, k, dy.dtype == jnp.bfloat16, time_major)
    da = jax.ShapeDtypeStruct(dy.shape[:2] + (width,), dy.dtype)
    outs = (da, jax.ShapeDtypeStruct((4 * k,), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.float32),
            jax.ShapeDtypeStruct((n, k), dy.dtype))
    return jax.ffi.ffi_call("jb_lstm_bptt", outs, vmap_method="sequential")(
        wh, gates, cs, c0, dy, dc_t, dh_t, time_major=time_major)


@lru_cache(maxsize=None)
def _bptt_vmappable(time_major):
    call = partial(_bptt_ffi, time_major=time_major)

    @jax.custom_batching.custom_vmap
    def bptt(wh, gates, cs, c0, dy, dc_t, dh_t):
        return tuple(call(wh, gates, cs, c0, dy, dc_t, dh_t))

    @bptt.def_vmap
    def bptt_vmap(size, in_batched, wh, gates, cs, c0, dy, dc_t, dh_t):
        if in_batched[0]:
            return tuple(_sequential(bptt, (wh, gates, cs, c0, dy, dc_t, dh_t), in_batched, size)), (True,) * 4
        # db sums over the mini-batch: folded, it is the sum over the mapped axis too, so
        # the folded call cannot give each mapped element its own; it runs per element.
        # The gate gradients (the expensive part) come from one folded call, and db from
        # them (a sum over every step and row of each element).
        xn = int(time_major)
        da, _, dc0, dh0 = call(wh, _fold(gates, in_batched[1], size, _GATES_N),
                               _fold(cs, in_batched[2], size, _CS_N),
                               _fold(c0, in_batched[3], size, 0),
                               _fold(dy, in_batched[4], size, xn),
                               _fold(dc_t, in_batched[5], size, 0),
                               _fold(dh_t, in_batched[6], size, 0))
        da = _unfold(da, size, xn)
        db = jnp.sum(da[..., :4 * wh.shape[0]].astype(jnp.float32), axis=(1, 2))
        return (da, db, _unfold(dc0, size, 0), _unfold(dh0, size, 0)), (True,) * 4

    return bptt


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _lstm(x, wi, wh, b, c0, h0, time_major):
    y, c_t, h_t, *_ = forward_call(x, wi, wh, b, c0, h0, time_major, save=False)
    return (c_t, h_t), y


def _lstm_fwd(x, wi, wh, b, c0, h0, time_major):
    y, c_t, h_t, gates, cs, xh = forward_call(x, wi, wh, b, c0, h0, time_major, save=True)
    return ((c_t, h_t), y), (wi, wh, gates, cs, c0, xh)


def _lstm_bwd(time_major, res, g):
    wi, wh, gates, cs, c0, xh = res
    (dc_t, dh_t), dy = g
    dt = xh.dtype
    da, db, dc0, dh0 = bptt_call(wh, gates, cs, c0, dy.astype(dt), dc_t.astype(jnp.float32),
                             dh_t.astype(dt), time_major)
    c, k = wi.shape[0], wh.shape[0]
    rows = xh.shape[0] * xh.shape[1]
    da2 = da.reshape(rows, da.shape[2])  # 4K columns and the padding, which the passes skip
    dx = fc_passes.backward_data_call(da2, wi).reshape(xh.shape[:2] + (c,))
    # dW and dR in one pass over the forward's [x_t | h_{t-1} | 0]: xh^T @ da summed over
    # every step, one GEMM reducing over all rows into C + K output rows; da is read once.
    dwr = fc_passes.weight_update_call(xh.reshape(rows, xh.shape[2]), da2, (c + k, 4 * k),
                                       wi.dtype, False)[0]
    return dx, dwr[:c], dwr[c:], db, dc0, dh0


_lstm.defvjp(_lstm_fwd, _lstm_bwd)
