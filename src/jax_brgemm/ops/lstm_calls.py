"""jb.lstm's custom calls and their vmap rules: the forward (``jb_lstm_fwd``), backward
through time (``jb_lstm_bptt``) and the tangent of the forward (``jb_lstm_tangent``, forward
mode), each one XLA FFI call over every time step (``cpp/layers/lstm``) and not
differentiable itself: ``ops/lstm.py`` makes primitives of them.

Under ``vmap`` with shared weights (the usual case: a batch of sequences through one layer)
the mapped axis is folded into the mini-batch N, so the kernels see one larger call; mapped
weights run one mapped element at a time (``lax.map``).
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _native  # registers the FFI targets
from jax_brgemm import precision as _precision

# No per-row last steps: every row's carry is the one after step T-1.
NO_STEPS = np.zeros((0,), np.int32)
# jb_lstm_fwd's variant attribute: 0 (automatic) runs the fused forward, the one there is.
_AUTOMATIC = 0


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


def forward_call(x, wi, wh, b, c0, h0, time_major, save, last_step=NO_STEPS, accuracy="float32"):
    """The forward over every step, one call (not differentiable): ``(y, c_T, h_T, gates,
    cell states, xh)``, the last three empty unless ``save`` (what the backward reads); with
    ``last_step`` (int32 (N,)) the carry is row n's after step ``last_step[n]``; float32
    products emulated at ``accuracy`` (``jax_brgemm.precision``)."""
    return _forward_vmappable(time_major, save, accuracy)(x, wi, wh, b, c0, h0, jnp.asarray(last_step))


def _forward_ffi(x, wi, wh, b, c0, h0, steps, time_major, save, accuracy):
    products = _precision.PRODUCTS[accuracy]
    t, n = (x.shape[0], x.shape[1]) if time_major else (x.shape[1], x.shape[0])
    k = wh.shape[0]
    y = jax.ShapeDtypeStruct(x.shape[:2] + (k,), x.dtype)
    carry = (jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), x.dtype))
    # The saved gates in the backward's K-blocks, each block's rows of four gates contiguous.
    shape = _native.lstm_saved_gates_shape(t, n, k, x.dtype == jnp.bfloat16, products)
    gates = jax.ShapeDtypeStruct(tuple(shape) if save else (0,), x.dtype)
    cs = jax.ShapeDtypeStruct((t, n, k) if save else (0,), jnp.float32)
    width = _native.lstm_saved_width(t, n, x.shape[2], k, x.dtype == jnp.bfloat16, time_major, products)
    xh = jax.ShapeDtypeStruct(x.shape[:2] + (width,) if save else (0,), x.dtype)
    return jax.ffi.ffi_call("jb_lstm_fwd", (y, *carry, gates, cs, xh), vmap_method="sequential")(
        x, wi, wh, b, c0, h0, steps, time_major=time_major, variant=np.int32(_AUTOMATIC),
        products=np.int64(products))


@lru_cache(maxsize=None)
def _forward_vmappable(time_major, save, accuracy):
    call = partial(_forward_ffi, time_major=time_major, save=save, accuracy=accuracy)

    @jax.custom_batching.custom_vmap
    def fwd(x, wi, wh, b, c0, h0, steps):
        return tuple(call(x, wi, wh, b, c0, h0, steps))

    @fwd.def_vmap
    def fwd_vmap(size, in_batched, x, wi, wh, b, c0, h0, steps):
        if any(in_batched[1:4]):
            outs = _sequential(fwd, (x, wi, wh, b, c0, h0, steps), in_batched, size)
        else:
            xn = int(time_major)
            y, c_t, h_t, gates, cs, xh = call(_fold(x, in_batched[0], size, xn), wi, wh, b,
                                              _fold(c0, in_batched[4], size, 0),
                                              _fold(h0, in_batched[5], size, 0),
                                              _fold(steps, in_batched[6], size, 0))
            outs = (_unfold(y, size, xn), _unfold(c_t, size, 0), _unfold(h_t, size, 0),
                    _unfold(gates, size, _GATES_N) if save else jnp.zeros((size, 0), gates.dtype),
                    _unfold(cs, size, _CS_N) if save else jnp.zeros((size, 0), cs.dtype),
                    _unfold(xh, size, xn) if save else jnp.zeros((size, 0), xh.dtype))
        return tuple(outs), (True,) * 6

    return fwd


def bptt_call(wh, gates, cs, c0, dy, dc_t, dh_t, time_major, last_step=NO_STEPS, accuracy="float32"):
    """Backward through time, one call (not differentiable): ``(da, db, dc0, dh0)``, ``da``
    every step's gate gradient in rows padded past 4K columns; ``dc_t``, ``dh_t`` are the
    gradients of the forward's carry (of the one ``last_step`` selected)."""
    return _bptt_vmappable(time_major, accuracy)(wh, gates, cs, c0, dy, dc_t, dh_t, jnp.asarray(last_step))


def _bptt_ffi(wh, gates, cs, c0, dy, dc_t, dh_t, steps, time_major, accuracy):
    n, k = c0.shape
    t = dy.shape[0] if time_major else dy.shape[1]
    # da's rows are padded (the first 4K columns are the gradient) away from a 4 KiB
    # period, so that the fully-connected passes after bptt read them in place.
    width = _native.lstm_da_width(t, n, k, dy.dtype == jnp.bfloat16, time_major)
    da = jax.ShapeDtypeStruct(dy.shape[:2] + (width,), dy.dtype)
    outs = (da, jax.ShapeDtypeStruct((4 * k,), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.float32),
            jax.ShapeDtypeStruct((n, k), dy.dtype))
    return jax.ffi.ffi_call("jb_lstm_bptt", outs, vmap_method="sequential")(
        wh, gates, cs, c0, dy, dc_t, dh_t, steps, time_major=time_major,
        products=np.int64(_precision.PRODUCTS[accuracy]))


@lru_cache(maxsize=None)
def _bptt_vmappable(time_major, accuracy):
    call = partial(_bptt_ffi, time_major=time_major, accuracy=accuracy)

    @jax.custom_batching.custom_vmap
    def bptt(wh, gates, cs, c0, dy, dc_t, dh_t, steps):
        return tuple(call(wh, gates, cs, c0, dy, dc_t, dh_t, steps))

    @bptt.def_vmap
    def bptt_vmap(size, in_batched, wh, gates, cs, c0, dy, dc_t, dh_t, steps):
        if in_batched[0]:
            args = (wh, gates, cs, c0, dy, dc_t, dh_t, steps)
            return tuple(_sequential(bptt, args, in_batched, size)), (True,) * 4
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
                               _fold(dh_t, in_batched[6], size, 0),
                               _fold(steps, in_batched[7], size, 0))
        da = _unfold(da, size, xn)
        db = jnp.sum(da[..., :4 * wh.shape[0]].astype(jnp.float32), axis=(1, 2))
        return (da, db, _unfold(dc0, size, 0), _unfold(dh0, size, 0)), (True,) * 4

    return bptt


def tangent_call(wh, gates, cs, c0, pieces, tb, tc0, th0, time_major, last_step=NO_STEPS, accuracy="float32"):
    """The forward's tangent over every step, one call (not differentiable): ``(ty, tc_T,
    th_T)`` from the forward's saves (``gates``, ``cs``, ``c0``), the tangents of the bias
    ``tb`` (4K) and of the initial carry, and ``pieces``: up to two arrays shaped like ``y``
    with 4K features, in its dtype, whose sum is the pre-activations' tangent but its
    recurrent part ``th_{t-1} @ wh``; with ``last_step`` the carry's is row n's after step
    ``last_step[n]``."""
    empty = jnp.zeros((0,), th0.dtype)
    tp0, tp1 = (list(pieces) + [empty, empty])[:2]
    return _tangent_vmappable(time_major, accuracy)(wh, gates, cs, c0, tp0, tp1, tb, tc0, th0,
                                                    jnp.asarray(last_step))


def _tangent_ffi(wh, gates, cs, c0, tp0, tp1, tb, tc0, th0, steps, time_major, accuracy):
    n, k = c0.shape
    t = cs.shape[0]
    ty = jax.ShapeDtypeStruct((t, n, k) if time_major else (n, t, k), th0.dtype)
    outs = (ty, jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), th0.dtype))
    return jax.ffi.ffi_call("jb_lstm_tangent", outs, vmap_method="sequential")(
        wh, gates, cs, c0, tp0, tp1, tb, tc0, th0, steps, time_major=time_major,
        products=np.int64(_precision.PRODUCTS[accuracy]))


@lru_cache(maxsize=None)
def _tangent_vmappable(time_major, accuracy):
    call = partial(_tangent_ffi, time_major=time_major, accuracy=accuracy)

    @jax.custom_batching.custom_vmap
    def tangent(wh, gates, cs, c0, tp0, tp1, tb, tc0, th0, steps):
        return tuple(call(wh, gates, cs, c0, tp0, tp1, tb, tc0, th0, steps))

    @tangent.def_vmap
    def tangent_vmap(size, in_batched, wh, gates, cs, c0, tp0, tp1, tb, tc0, th0, steps):
        args = (wh, gates, cs, c0, tp0, tp1, tb, tc0, th0, steps)
        if in_batched[0]:
            return tuple(_sequential(tangent, args, in_batched, size)), (True,) * 3
        xn, n = int(time_major), c0.shape[-2]
        # an absent piece stays absent; the bias tangent becomes one per row of the folded N
        tps = [p[0] if p.shape[-1] == 0 and b else p if p.shape[-1] == 0 else _fold(p, b, size, xn)
               for p, b in ((tp0, in_batched[4]), (tp1, in_batched[5]))]
        if in_batched[6] or tb.ndim == 2:  # (B, 4K), (B, N, 4K) or, unbatched, (N, 4K)
            if not in_batched[6]:
                tb = tb[None]
            elif tb.ndim == 2:
                tb = tb[:, None, :]
            tb = _fold(jnp.broadcast_to(tb, (size, n, tb.shape[-1])), True, size, 0)
        # the folded call is the custom_vmap one again: an outer vmap folds its axis too
        ty, tc, th = tangent(wh, _fold(gates, in_batched[1], size, _GATES_N), _fold(cs, in_batched[2], size, _CS_N),
                          _fold(c0, in_batched[3], size, 0), *tps, tb, _fold(tc0, in_batched[7], size, 0),
                          _fold(th0, in_batched[8], size, 0), _fold(steps, in_batched[9], size, 0))
        return (_unfold(ty, size, xn), _unfold(tc, size, 0), _unfold(th, size, 0)), (True,) * 3

    return tangent
