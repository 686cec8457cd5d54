"""jb.lstm: a whole LSTM sequence as BRGEMM custom calls, differentiable in both modes.

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

* Forward mode: the pre-activations' tangent but its recurrent part, ``tx @ kernel_i +
  [x | h_prev] @ [tkernel_i; tkernel_h]``, is one or two fully-connected passes over every
  step at once (the second over the saved ``xh``; a zero tangent's pass is not run), and
  ``jb_lstm_tangent`` the recurrence, one call: per step ``th_{t-1} @ kernel_h`` by BRGEMM,
  fused with the gate and cell derivatives from the saved gates and cell states (``tc_t``,
  ``th_t``).

With ``seq_lengths`` (sequences padded to T) the forward and the tangent take each row's
carry after its own last step, and bptt takes that carry's gradient in at the same steps:
the plain path's final carry and its gradient, moved per row.

Under ``vmap`` with shared weights the mapped axis is folded into the mini-batch (one call of
each kind for the whole map); mapped weights run one element at a time (``lax.map``). The
calls and their vmap rules are in ``ops/lstm_calls.py``.

The forward, the gradients and forward-mode tangents run on the kernels (primitives at the
end of this file); second derivatives are the reference scan's, in XLA.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from jax_brgemm import _validate as check
from jax_brgemm import precision as _precision
from jax_brgemm.ops import emulation, fc_passes
from jax_brgemm.ops.lstm_calls import NO_STEPS as _NO_STEPS
from jax_brgemm.ops.lstm_calls import bptt_call, forward_call, tangent_call
from jax_brgemm.ops.primitive import (define, is_zero, over_leading, shapes_of, unbroadcast, undefined, zero,
                                      zero_like)


@emulation.exact_on_infinity("x", "kernel_i", "kernel_h", "initial_carry")
def lstm(x, kernel_i, kernel_h, bias, *, initial_carry=None, time_major=False, dtype=None,
         seq_lengths=None, precision=None):
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
      seq_lengths: ``(N,)`` integers, the length of each sequence padded to T: the carry
        returned is then each row's own, after its step ``seq_lengths[n] - 1``, as
        ``flax.linen.RNN(..., return_carry=True)`` selects it (that index read as JAX
        indexing reads it: 0 and negative values count from the end, an index past either
        end is the step at that end). Every step still runs for every row, and ``y`` has
        them all. As in stock Flax, whose gather clamps such an index but whose gradient
        drops it, a row whose index is past an end (``seq_lengths`` above T or below
        1 - T) gets no gradient through its carry.
      precision: the accuracy asked of the products, as ``lax.dot_general`` takes it (a
        ``lax.Precision``, a pair, a ``lax.DotAlgorithmPreset`` or their names; None follows
        ``jax.default_matmul_precision``), computed as ``jax_brgemm.precision`` says: exact
        float32, or where it emulates them (AMX) from bfloat16 products (the kernels split
        each step's h and gate gradient where they make them). An algorithm outside its
        table is a ValueError.

    Returns:
      ``(carry, y)``: ``carry = (c_T, h_T)`` (or each row's with ``seq_lengths``) with
      ``c_T`` float32 and ``h_T`` ``(N, K)`` in the computation dtype, and ``y`` every
      ``h_t``, shaped like ``x`` with K features. Differentiable in ``x``, both kernels, the
      bias and the initial carry, from ``y`` and from the carry, to any order in reverse
      and forward mode: the first derivative (gradient or tangent) on the kernels, higher
      ones through the reference scan's derivatives in XLA.

    Sizes of 0 (N, T, C or K) compute what the stock scan computes, in XLA (for T = 0 the
    initial carry passes through); so does float64 (with ``jax_enable_x64``: a NumPy
    float64 array is float32 otherwise, as JAX canonicalizes it), with a float64 cell state.
    """
    op = "jb.lstm"
    x = check.array(x, "x", op, check.OP_DTYPES)
    kernel_i = check.array(kernel_i, "kernel_i", op, check.OP_DTYPES)
    kernel_h = check.array(kernel_h, "kernel_h", op, check.OP_DTYPES)
    bias = check.array(bias, "bias", op, check.OP_DTYPES)
    computed = _precision.computed(_precision.accuracy(precision, op), op)
    check.rank(x, "x", op, "(T, N, C)" if time_major else "(N, T, C)", exactly=3)
    check.rank(kernel_h, "kernel_h", op, "(K, 4K)", exactly=2)
    k = kernel_h.shape[0]
    if kernel_h.shape[1] != 4 * k:
        raise ValueError(f"{op}: kernel_h must be (K, 4K), got shape {kernel_h.shape}")
    t, n, c = (x.shape if time_major else (x.shape[1], x.shape[0], x.shape[2]))
    check.rank(kernel_i, "kernel_i", op, "(C, 4K)", exactly=2)
    check.shape(kernel_i, "kernel_i", op, (c, 4 * k), "(C, 4K)")
    check.shape(bias, "bias", op, (4 * k,), "(4K,)")
    dtype = check.compute_dtype(op, dtype, x, kernel_i, kernel_h, dtypes=check.OP_DTYPES)
    # the cell state's dtype: float32 on the kernels, float64 in float64
    state = jnp.promote_types(dtype, jnp.float32)
    x = x.astype(dtype)
    # The kernels go in as they are (cast while re-blocked) when both share a dtype.
    wdt = jnp.result_type(kernel_i, kernel_h)
    kernel_i, kernel_h = (check.kernel_operand(w.astype(wdt), dtype) for w in (kernel_i, kernel_h))
    bias = bias.astype(state)

    if initial_carry is None:
        c0 = jnp.zeros((n, k), state)
        h0 = jnp.zeros((n, k), dtype)
    else:
        if not isinstance(initial_carry, (tuple, list)) or len(initial_carry) != 2:
            raise ValueError(f"{op}: initial_carry must be a pair (c0, h0) of (N, K) arrays")
        floats = (*check.OP_DTYPES, np.dtype(np.float16))
        c0 = check.array(initial_carry[0], "initial_carry[0] (c0)", op, floats)
        h0 = check.array(initial_carry[1], "initial_carry[1] (h0)", op, floats)
        check.shape(c0, "initial_carry[0] (c0)", op, (n, k), "(N, K)")
        check.shape(h0, "initial_carry[1] (h0)", op, (n, k), "(N, K)")
        c0 = c0.astype(state)
        h0 = h0.astype(dtype)
    steps = _NO_STEPS if seq_lengths is None else last_steps(seq_lengths, n, t, op)

    if min(n, t, c, k) < 1 or dtype not in check.KERNEL_DTYPES:
        carry, y = reference(x, kernel_i, kernel_h, bias, c0, h0, bool(time_major), steps)
    else:
        # bfloat16 computations are exact in one product whatever the precision
        accuracy = computed if dtype == jnp.float32 else "float32"
        carry, y = _lstm(x, kernel_i, kernel_h, bias, c0, h0, steps, bool(time_major), accuracy)
    if seq_lengths is not None:
        # the stock gather's gradient drops an index past either end (its value is clamped)
        index = jnp.asarray(seq_lengths) - 1
        index = jnp.where(index < 0, index + t, index)
        inside = ((index >= 0) & (index < t))[:, None]
        carry = tuple(jnp.where(inside, a, jax.lax.stop_gradient(a)) for a in carry)
    return carry, y


def last_steps(seq_lengths, n, t, op):
    """Each row's last step, ``seq_lengths - 1`` read as ``flax.linen.RNN`` reads it (JAX
    indexing into the T steps: negative from the end, clamped to [0, T)), as int32 ``(N,)``;
    a TypeError / ValueError from ``op`` for a non-integer or misshapen ``seq_lengths``."""
    if not hasattr(seq_lengths, "dtype"):
        try:
            seq_lengths = np.asarray(seq_lengths)
        except (TypeError, ValueError):
            raise TypeError(f"{op}: seq_lengths must be an integer array, got "
                            f"{type(seq_lengths).__name__}") from None
    kind = np.dtype(seq_lengths.dtype).kind
    if kind not in "iu":
        raise TypeError(f"{op}: seq_lengths must be an integer array, got {seq_lengths.dtype}")
    if tuple(seq_lengths.shape) != (n,):
        raise ValueError(f"{op}: seq_lengths must have shape (N,) = ({n},), got "
                         f"{tuple(seq_lengths.shape)}")
    if t == 0:
        raise ValueError(f"{op}: seq_lengths needs at least one time step to take a carry from")
    # the very index stock Flax gathers with: arange(T)[seq_lengths - 1]
    return jnp.arange(t, dtype=jnp.int32)[jnp.asarray(seq_lengths) - 1]


def reference(x, wi, wh, b, c0, h0, time_major, last_step=_NO_STEPS):
    """What the kernels compute, as ``flax.linen.OptimizedLSTMCell`` in a ``lax.scan``:
    products in ``x``'s dtype accumulated in ``c0``'s (the cell state's: float32, or
    float64), element-wise math in it, ``h`` in ``x``'s dtype; the carry after step T-1, or
    with ``last_step`` (N,) row n's after step ``last_step[n]``. For the sizes and dtypes
    the kernels do not take (a size of 0, float64), and for derivatives of order two and
    more."""
    state = c0.dtype
    select = last_step.shape[0] > 0
    wi, wh = wi.astype(x.dtype), wh.astype(x.dtype)

    def step(carry, xt):
        cs, h = carry
        z = (jnp.matmul(xt, wi, preferred_element_type=state)
             + jnp.matmul(h, wh, preferred_element_type=state) + b.astype(state))
        i, f, g, o = jnp.split(z, 4, axis=-1)
        cs = jax.nn.sigmoid(f) * cs + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = (jax.nn.sigmoid(o) * jnp.tanh(cs)).astype(x.dtype)
        return (cs, h), ((cs, h) if select else h)

    carry, y = jax.lax.scan(step, (c0, h0), x if time_major else jnp.swapaxes(x, 0, 1))
    if select:  # every step's carry, (T, N, K) each, and each row's from its step
        (cs, y) = y
        rows = jnp.arange(last_step.shape[0])
        carry = (cs[last_step, rows], y[last_step, rows])
    return carry, (y if time_major else jnp.swapaxes(y, 0, 1))


# --- the primitives -------------------------------------------------------------------------
# lstm_p: the forward on the kernels, saving what bptt reads when ``save``. Its JVP runs the
# saving forward and tangent_p, linear in the arguments' tangents, whose transpose (reverse
# mode) is backward_p: bptt and two fully-connected passes over every step, on the kernels.
# tangent_p itself (forward mode) is on the kernels too: one or two fully-connected passes
# over every step and the tangent pass (``nonzero``: which of the tangents of x, kernel_i,
# kernel_h are not zeros, so that the passes of the others are not run). The derivatives of
# tangent_p and backward_p (second order) are the reference scan's, in XLA. The saved tensors
# are functions of the arguments, which those derivatives account for through the arguments
# themselves. ``steps`` (each row's last step, or empty) is an integer: no tangent.
# ``accuracy`` is the products' (precision.py). Leading dims (vmap's) are mapped by jax.vmap
# over the unbatched calls, whose own vmap rules fold them into the mini-batch.

_ARGS = (3, 2, 2, 1, 2, 2)  # the ranks of x, kernel_i, kernel_h, bias, c0, h0
_SAVED = (4, 3, 3)  # gates, cell states, xh


def _forward(x, wi, wh, b, c0, h0, steps, *, time_major, save, accuracy):
    return tuple(forward_call(x, wi, wh, b, c0, h0, time_major, save, steps, accuracy))


def _kernel_tangent(tx, twi, twh, tb, tc0, th0, x, wi, wh, b, c0, h0, gates, cs, xh, steps, *, time_major,
                    accuracy, nonzero):
    """The tangents of y and of the carry: the pre-activations' tangent but its recurrent
    part, ``tx @ wi + x @ twi + h_prev @ twh``, by fully-connected passes over every step at
    once (the second over the forward's ``xh = [x | h_prev | 0]``), then the recurrence in
    the tangent pass."""
    c, k = wi.shape[0], wh.shape[0]
    width, rows = xh.shape[2], xh.shape[0] * xh.shape[1]
    products = _precision.PRODUCTS[accuracy]  # the passes split their operands as they re-block
    pieces = []
    if nonzero[0]:
        pieces.append(fc_passes.forward(tx.reshape(rows, c), wi, None, fc_passes.NONE, products)[0])
    if nonzero[1] or nonzero[2]:  # [twi; twh; 0] against the rows of xh, its padding included
        tw = jnp.concatenate([twi, twh.astype(twi.dtype), jnp.zeros((width - c - k, 4 * k), twi.dtype)])
        pieces.append(fc_passes.forward(xh.reshape(rows, width), tw, None, fc_passes.NONE, products)[0])
    pieces = [p.reshape(xh.shape[:2] + (4 * k,)) for p in pieces]
    return tuple(tangent_call(wh, gates, cs, c0, pieces, tb.astype(jnp.float32), tc0.astype(jnp.float32),
                              th0.astype(xh.dtype), time_major, steps, accuracy))


def _stock_tangent(tx, twi, twh, tb, tc0, th0, x, wi, wh, b, c0, h0, gates, cs, xh, steps, *, time_major,
                   accuracy, nonzero):
    _, ((tc, th), ty) = jax.jvp(lambda *a: reference(*a, time_major, steps), (x, wi, wh, b, c0, h0),
                                (tx, twi, twh, tb, tc0, th0))
    return ty, tc, th


def _kernel_grads(x, wi, wh, b, c0, h0, gates, cs, xh, dc_t, dh_t, dy, steps, *, time_major, accuracy, wants):
    """The gradients of x, wi, wh, b, c0, h0 from the cotangents of the carry (c_T, h_T, or
    each row's after its step in ``steps``) and y; zeros for those not in ``wants``."""
    dt = xh.dtype
    da, db, dc0, dh0 = bptt_call(wh, gates, cs, c0, dy.astype(dt), dc_t.astype(jnp.float32),
                                 dh_t.astype(dt), time_major, steps, accuracy)
    c, k = wi.shape[0], wh.shape[0]
    rows = xh.shape[0] * xh.shape[1]
    da2 = da.reshape(rows, da.shape[2])  # 4K columns and the padding, which the passes skip
    xh2 = xh.reshape(rows, xh.shape[2])
    products = _precision.PRODUCTS[accuracy]  # the passes split da, xh and W as they re-block
    dx = jnp.zeros(x.shape, x.dtype)
    if wants[0]:
        dx = fc_passes.backward_data(da2, wi, products).reshape(xh.shape[:2] + (c,)).astype(x.dtype)
    dwi, dwh = jnp.zeros(wi.shape, wi.dtype), jnp.zeros(wh.shape, wh.dtype)
    if wants[1] or wants[2]:
        # dW and dR in one pass over the forward's [x_t | h_{t-1} | 0]: xh^T @ da summed
        # over every step, one GEMM reducing over all rows into C + K output rows.
        dwr = fc_passes.weight_update(xh2, da2, (c + k, 4 * k), wi.dtype, False, products)[0]
        dwi, dwh = dwr[:c], dwr[c:]
    return dx, dwi, dwh, db.astype(b.dtype), dc0.astype(c0.dtype), dh0.astype(h0.dtype)


def _stock_grads(x, wi, wh, b, c0, h0, gates, cs, xh, dc_t, dh_t, dy, steps, *, time_major, accuracy, wants):
    _, vjp = jax.vjp(lambda *a: reference(*a, time_major, steps), x, wi, wh, b, c0, h0)
    grads = vjp(((dc_t.astype(c0.dtype), dh_t.astype(h0.dtype)), dy.astype(x.dtype)))
    return tuple(g if w else jnp.zeros_like(g) for g, w in zip(grads, wants))


def _mapped(fn, ranks):
    """``fn`` over vmap's leading dims."""
    return lambda *args, **params: over_leading(partial(fn, **params), ranks, *args)


def _define(name, fn, ranks, partitioned):
    return define(name, shapes_of(_mapped(fn, ranks)), _mapped(fn, ranks), core_ranks=ranks, partitioned=partitioned)


_FORWARD_RANKS = _ARGS + (1,)
_TANGENT_RANKS = _ARGS + _ARGS + _SAVED + (1,)
_BACKWARD_RANKS = _ARGS + _SAVED + (2, 2, 3, 1)
lstm_p = _define("jb_lstm", _forward, _FORWARD_RANKS, partitioned=False)
# (their FC passes lower through custom_partitioning)
tangent_p = _define("jb_lstm_tangent", _kernel_tangent, _TANGENT_RANKS, partitioned=True)
backward_p = _define("jb_lstm_backward", _kernel_grads, _BACKWARD_RANKS, partitioned=True)


def _lstm(x, wi, wh, b, c0, h0, steps, time_major, accuracy):
    y, c_t, h_t, *_ = lstm_p.bind(x, wi, wh, b, c0, h0, steps, time_major=time_major, save=False,
                                  accuracy=accuracy)
    return (c_t, h_t), y


def _lstm_jvp(primals, tangents, *, time_major, save, accuracy):
    y, c_t, h_t, *saved = lstm_p.bind(*primals, time_major=time_major, save=True, accuracy=accuracy)
    outs = [y, c_t, h_t] + (saved if save else [jnp.zeros(o.shape, o.dtype) for o in shapes_of(_mapped(
        _forward, _FORWARD_RANKS))(*primals, time_major=time_major, save=False, accuracy=accuracy)[3:]])
    if all(is_zero(t) for t in tangents[:6]):
        return outs, [zero(o) for o in outs]
    # a zero tangent as zeros (a constant: the transpose computes no gradient for it)
    t_args = [jnp.zeros(p.shape, p.dtype) if is_zero(t) else t for p, t in zip(primals[:6], tangents[:6])]
    nonzero = tuple(not is_zero(t) for t in tangents[:3])
    ty, tc, th = tangent_p.bind(*t_args, *primals[:6], *saved, primals[6], time_major=time_major, accuracy=accuracy,
                                nonzero=nonzero)
    return outs, [ty, tc, th] + [zero(o) for o in outs[3:]]


def _tangent_transpose(cts, *args, time_major, accuracy, nonzero):
    tangents, rest = args[:6], args[6:]
    wants = tuple(undefined(t) for t in tangents)
    if all(is_zero(ct) for ct in cts):
        return [zero_like(t) if w else None for t, w in zip(tangents, wants)] + [None] * 10
    x, wi, wh, b, c0, h0, gates, cs, xh, steps = rest
    y = jax.ShapeDtypeStruct(x.shape[:-1] + wh.shape[-2:-1], x.dtype)
    ct_y, ct_c, ct_h = (jnp.zeros(a.shape, a.dtype) if is_zero(ct) else ct for ct, a in zip(cts, (y, c0, h0)))
    grads = backward_p.bind(x, wi, wh, b, c0, h0, gates, cs, xh, ct_c, ct_h, ct_y, steps, time_major=time_major,
                            accuracy=accuracy, wants=wants)
    return [unbroadcast(g.astype(t.aval.dtype), t.aval.shape) if w else None
            for g, t, w in zip(grads, tangents, wants)] + [None] * 10


def _in_xla_jvp(fn, prim):
    """A JVP rule: the reference's, for the derivatives the kernels do not compute (the
    saved tensors and ``steps`` get none, see above)."""
    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        floats = [i for i, p in enumerate(primals) if jnp.issubdtype(p.dtype, jnp.floating)]
        run = _mapped(fn, _TANGENT_RANKS if prim is tangent_p else _BACKWARD_RANKS)

        def of_floats(*args):
            full = list(primals)
            for i, a in zip(floats, args):
                full[i] = a
            return run(*full, **params)

        t_in = [jnp.zeros(primals[i].shape, primals[i].dtype) if is_zero(tangents[i]) else tangents[i]
                for i in floats]
        return out, jax.jvp(of_floats, [primals[i] for i in floats], t_in)[1]
    return jvp


ad.primitive_jvps[lstm_p] = _lstm_jvp
ad.primitive_transposes[tangent_p] = _tangent_transpose
ad.primitive_jvps[tangent_p] = _in_xla_jvp(_stock_tangent, tangent_p)
ad.primitive_jvps[backward_p] = _in_xla_jvp(_stock_grads, backward_p)
