"""jb.dot_product_attention: scaled dot-product attention as BRGEMM custom calls,
differentiable in both modes.

Two XLA FFI calls into ``cpp/layers/attention`` (flash-style: the T x S scores are never
stored, a query block keeps one tile of them; attention dropout is a bit per weight,
``jax.random.bernoulli``'s for flax's shape, packed here and applied in the kernels):

* ``jb_attention_fwd``: ``softmax(scale * q k^T + bias, masked) v`` per query block, over key
  chunks with an online softmax; it also returns each row's max and sum (float32), all the
  backward needs besides the inputs and the output.
* ``jb_attention_bwd``: dq, dk and dv in one pass (P and dP recomputed per chunk from the
  saved statistics), and, when the bias is differentiated, the gradient of a full
  ``(B, N, T, S)`` bias, summed here over the dims the bias broadcasts along.

* ``jb_attention_jvp``: the forward-mode tangent of the output in one pass (tS from
  ``tQ K^T + Q tK^T``, P from the saved statistics; ``Z tV + (Z tS) V - c O``), exact products.

The value, the gradient and the forward-mode tangent run on these calls (the gradient is the
transpose of the tangent, see the primitives at the end). Second and higher derivatives go
through the stock formula, ``jax.nn.dot_product_attention``'s, in XLA: exact, not on the
kernels (they have no pass for them).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from jax_brgemm import _native  # noqa: F401  (registers the FFI targets)
from jax_brgemm import _validate as check
from jax_brgemm import precision as _precision
from jax_brgemm.ops import emulation, partitioning, random
from jax_brgemm.ops.primitive import (define, is_zero, over_leading, shapes_of, unbroadcast, undefined, zero,
                                      zero_like)

_FLOATS = (*check.KERNEL_DTYPES, np.dtype(np.float16), np.dtype(np.float64))


@emulation.exact_on_infinity("query", "key", "value")
def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          precision=None, dropout_rate=0.0, dropout_rng=None, broadcast_dropout=True):
    """Scaled dot-product attention on the BRGEMM kernels, as ``jax.nn.dot_product_attention``.

    ``softmax(scale * query @ key^T + bias, where masked: a large negative) @ value`` per head,
    with the softmax in float32.

    Args:
      query: ``(B, T, N, H)`` or ``(T, N, H)``, float32 or bfloat16.
      key: ``(B, S, K, H)`` or ``(S, K, H)`` with K dividing N (grouped-query attention: query
        head n uses key/value head ``n // (N // K)``); query's dtype.
      value: key's shape and dtype.
      bias: optional, added to the logits; rank <= 4 and broadcastable to ``(B, N, T, S)``
        (``(N, T, S)`` unbatched). Any float dtype; added in float32.
      mask: optional boolean, True where a query attends to a key; shaped like ``bias``.
      scale: the logits' scale, a Python number; ``None`` means ``1 / sqrt(H)``.
      is_causal: query ``i`` attends to keys ``j <= i`` only.
      precision: the accuracy asked of the products, as ``lax.dot_general`` takes it (a
        ``lax.Precision``, a pair, a ``lax.DotAlgorithmPreset`` or their names; None follows
        ``jax.default_matmul_precision``), computed as ``jax_brgemm.precision`` says: exact
        float32, or where it emulates them (AMX) from bfloat16 products (the kernel splits
        the probabilities and their gradient where it makes them). An algorithm outside its
        table is a ValueError.
      dropout_rate: attention dropout, a Python number in [0, 1): each weight of the softmax
        is dropped with this probability and the kept ones scaled by ``1 / (1 - rate)``, as
        ``flax.linen.dot_product_attention`` with ``deterministic=False`` does: for the same
        ``dropout_rng`` and ``broadcast_dropout`` the same weights are kept (the keep-mask is
        ``jax.random.bernoulli`` of flax's shape). 0 (the default): none.
      dropout_rng: the PRNG key of the dropout; required when ``dropout_rate > 0``.
      broadcast_dropout: one keep-mask of ``(T, S)`` shared by the batch and the heads
        (flax's default), else one per ``(B, N)``.

    Returns:
      query's shape and dtype. A fully masked row attends uniformly to every key, as in jax.
      Differentiable in query, key, value and bias. Sizes of 0, and float64 (which exists
      with ``jax_enable_x64`` only), compute what ``jax.nn.dot_product_attention`` computes,
      in XLA.
    """
    op = "jb.dot_product_attention"
    query = check.array(query, "query", op, check.OP_DTYPES)
    key = check.array(key, "key", op, check.OP_DTYPES)
    value = check.array(value, "value", op, check.OP_DTYPES)
    for name, a in (("query", query), ("key", key), ("value", value)):
        if a.ndim not in (3, 4):
            raise ValueError(f"{op}: {name} must be (B, {'T' if name == 'query' else 'S'}, heads, H) or "
                             f"unbatched without B (rank 3 or 4), got shape {tuple(a.shape)}")
    check.same_dtype(op, query=query, key=key, value=value)
    computed = _precision.computed(_precision.accuracy(precision, op), op)
    q, k, v = (a if a.ndim == 4 else a[None] for a in (query, key, value))
    b, t, n, h = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{op}: value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    if k.shape[0] != b or k.shape[3] != h:
        raise ValueError(f"{op}: key {tuple(key.shape)} must have query's batch B = {b} and head dim "
                         f"H = {h} (query {tuple(query.shape)})")
    s, kv_heads = k.shape[1], k.shape[2]
    if kv_heads < 1 and n > 0 or kv_heads > 0 and n % kv_heads:
        raise ValueError(f"{op}: the key/value heads K = {kv_heads} must divide the query heads N = {n}")
    full = (b, n, t, s)
    if bias is not None:
        bias = _broadcastable(check.array(bias, "bias", op, _FLOATS), "bias", full, op)
    if mask is not None:
        if not hasattr(mask, "dtype") or np.dtype(mask.dtype) != np.dtype(bool):
            raise TypeError(f"{op}: mask must be a boolean array, got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        mask = _broadcastable(jnp.asarray(mask), "mask", full, op)
    scale = _scale(scale, h, op)
    causal = bool(is_causal)
    keep, keep_scale = _dropout(dropout_rate, dropout_rng, broadcast_dropout, query.ndim, full, op)

    # Nothing for the kernels (a size of 0: an empty or zero result), or float64 (x64): stock.
    if 0 in (b, t, n, h, s) or np.dtype(q.dtype) == np.dtype(np.float64):
        y = _reference(q, k, v, *(_or_empty(a, d) for a, d in ((bias, q.dtype), (mask, jnp.bool_), (keep, jnp.uint8))),
                       scale, (causal, 0, keep_scale))
        return y.reshape(query.shape)
    bias4 = None if bias is None else bias.astype(jnp.float32)
    # bfloat16 inputs are exact in one product whatever the precision
    products = _precision.PRODUCTS[computed] if q.dtype == jnp.float32 else 0
    o, _ = _attention(q, k, v, bias4, mask, keep, scale, (causal, products, keep_scale))
    return o.reshape(query.shape)


def _broadcastable(a, name, full, op):
    """``a`` as a rank-4 array whose dims are each 1 or the full dim of (B, N, T, S)."""
    if a.ndim > 4:
        raise ValueError(f"{op}: {name} must have rank <= 4 (broadcastable to (B, N, T, S) = {full}), "
                         f"got shape {tuple(a.shape)}")
    a4 = a.reshape((1,) * (4 - a.ndim) + tuple(a.shape))
    if any(d != 1 and d != f for d, f in zip(a4.shape, full)):
        raise ValueError(f"{op}: {name} {tuple(a.shape)} does not broadcast to (B, N, T, S) = {full}")
    return a4


def _dropout(rate, rng, broadcast, ndim, full, op):
    """(keep bits (b or 1, n or 1, T, ceil(S / 8)) uint8, bit j % 8 of byte j / 8 set where
    key j is kept; 1 / keep_prob as float32), or (None, 1.0) without dropout. The bits are
    ``jax.random.bernoulli(rng, 1 - rate, shape)``'s for the shape flax draws them in, drawn
    and packed on the cores (``ops/random.py``)."""
    try:
        rate = float(rate)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"{op}: dropout_rate must be a Python number (static), got {rate!r}") from None
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{op}: dropout_rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return None, 1.0
    if rng is None:
        raise ValueError(f"{op}: dropout_rng is required when dropout_rate > 0 (got dropout_rate={rate})")
    b, n, t, s = full
    keep_prob = 1.0 - rate
    # flax's shapes: (1, ..., T, S) broadcast over the batch and heads, else the weights'
    shape = (1,) * (ndim - 2) + (t, s) if broadcast else ((b,) if ndim == 4 else ()) + (n, t, s)
    bits = random.bernoulli_bits(rng, keep_prob, shape)
    return bits.reshape((1, 1, t, -1) if broadcast else (b, n, t, -1)), float(np.float32(1.0) / np.float32(keep_prob))


def _scale(scale, h, op):
    if scale is None:
        return 1.0 / math.sqrt(h) if h else 1.0
    try:
        return float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"{op}: scale must be a Python number (static), got {scale!r}") from None


# --- the custom calls --------------------------------------------------------------------
# Leading dims (vmap's, ops/primitive.py) go to the handlers as they are: they fold them into
# the batch and read unmapped operands in place. At top level each call is
# batch-partitionable (partitioning.rows): under jit with the batch B sharded, it runs per
# shard; a bias or mask broadcast over B is replicated, and the gradient of such a bias is a
# per-shard partial sum, psum'ed. An absent bias or mask is an empty array.


def _or_empty(a, dtype):
    return jnp.zeros((0,), dtype) if a is None else a


def _present(a):
    return a.shape[-1] != 0


def _attrs(kind):
    """The FFI attributes of ``kind``: (is_causal, the bfloat16 products each product is
    emulated from (0: exact float32), a kept weight's factor 1 / keep_prob)."""
    causal, products, keep_scale = kind
    return {"causal": bool(causal), "products": np.int64(products), "keep_scale": np.float32(keep_scale)}


def _forward_ffi(q, k, v, bias, mask, keep, *, scale, kind):
    lead, (b, t, n, _) = q.shape[:-4], q.shape[-4:]
    lead = jnp.broadcast_shapes(lead, *(a.shape[:-4] for a in (k, v, bias, mask, keep) if a.ndim > 1))
    outs = (jax.ShapeDtypeStruct(lead + q.shape[-4:], q.dtype), jax.ShapeDtypeStruct(lead + (b, n, t, 2), jnp.float32))
    return tuple(jax.ffi.ffi_call("jb_attention_fwd", outs)(q, k, v, bias, mask, keep, scale=np.float32(scale),
                                                            **_attrs(kind)))


def _backward_ffi(q, k, v, bias, mask, keep, o, stats, do, *, scale, kind, want_dbias):
    lead = jnp.broadcast_shapes(*(a.shape[:-4] for a in (q, k, v, bias, mask, keep, o, stats, do) if a.ndim > 1))
    b, t, n, _ = q.shape[-4:]
    full = (b, n, t, k.shape[-3])
    outs = (jax.ShapeDtypeStruct(lead + q.shape[-4:], q.dtype), jax.ShapeDtypeStruct(lead + k.shape[-4:], k.dtype),
            jax.ShapeDtypeStruct(lead + v.shape[-4:], v.dtype),
            jax.ShapeDtypeStruct(lead + (full if want_dbias else (0,)), jnp.float32))
    dq, dk, dv, dbias = jax.ffi.ffi_call("jb_attention_bwd", outs)(
        q, k, v, bias, mask, keep, o, stats, do, scale=np.float32(scale), **_attrs(kind))
    if want_dbias:  # back to the bias's shape: summed over the dims it broadcasts along
        axes = tuple(dbias.ndim - 4 + i for i, (d, f) in enumerate(zip(bias.shape[-4:], full)) if d == 1 and f != 1)
        dbias = jnp.sum(dbias, axis=axes, keepdims=True) if axes else dbias
    return dq, dk, dv, dbias


def _tangent_ffi(tq, tk, tv, tb, q, k, v, bias, mask, keep, o, stats, *, scale, kind):
    """The forward-mode tangent of o (exact products, whatever the precision)."""
    lead = jnp.broadcast_shapes(*(a.shape[:-4] for a in (tq, tk, tv, tb, q, k, v, bias, mask, keep, o, stats)
                                  if a.ndim > 1))
    out = jax.ShapeDtypeStruct(lead + q.shape[-4:], q.dtype)
    exact = (kind[0], 0, kind[2])
    return jax.ffi.ffi_call("jb_attention_jvp", out)(q, k, v, bias, mask, keep, o, stats, tq.astype(q.dtype),
                                                     tk.astype(k.dtype), tv.astype(v.dtype), tb.astype(jnp.float32),
                                                     scale=np.float32(scale), **_attrs(exact))


_R, _SUM = partitioning.ROWS, partitioning.SUM


def _batch_kind(a, b):
    """Split a bias or mask with the batch when it has the batch's B; else replicate it."""
    return _R if _present(a) and a.shape[0] == b else None


@partitioning.cached
def _forward_target(scale, kind, bias_kind, mask_kind, keep_kind):
    return partitioning.rows(partial(_forward_ffi, scale=scale, kind=kind),
                             (_R, _R, _R, bias_kind, mask_kind, keep_kind), (_R, _R))


@partitioning.cached
def _backward_target(scale, kind, want_dbias, bias_kind, mask_kind, keep_kind):
    # A bias shared by the batch gets every shard's contribution to its gradient: a sum.
    return partitioning.rows(
        partial(_backward_ffi, scale=scale, kind=kind, want_dbias=want_dbias),
        (_R, _R, _R, bias_kind, mask_kind, keep_kind, _R, _R, _R), (_R, _R, _R, bias_kind or _SUM))


def _forward_call(q, k, v, bias, mask, keep, *, scale, kind):
    if q.ndim > 4:
        return _forward_ffi(q, k, v, bias, mask, keep, scale=scale, kind=kind)
    kinds = (_batch_kind(a, q.shape[0]) for a in (bias, mask, keep))
    return _forward_target(scale, kind, *kinds)(q, k, v, bias, mask, keep)


def _backward_call(q, k, v, bias, mask, keep, o, stats, do, *, scale, kind, want_dbias):
    if q.ndim > 4:
        return _backward_ffi(q, k, v, bias, mask, keep, o, stats, do, scale=scale, kind=kind, want_dbias=want_dbias)
    kinds = (_batch_kind(a, q.shape[0]) for a in (bias, mask, keep))
    return _backward_target(scale, kind, want_dbias, *kinds)(q, k, v, bias, mask, keep, o, stats, do)


# --- the stock formula, for the derivatives the kernels do not compute ------------------------


def _reference(q, k, v, bias, mask, keep, scale, kind):
    """jax.nn.dot_product_attention, with the weights times the dropout's factor where keep
    (the kernels' bits) is given: (B, T, N, H) operands, the T x S weights in XLA."""
    bias, mask = (a if _present(a) else None for a in (bias, mask))
    if not _present(keep):
        return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, is_causal=kind[0])
    (b, t, n, h), (s, kv) = q.shape, k.shape[1:3]
    k, v = (jnp.repeat(a, n // kv, axis=2) for a in (k, v))
    x = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        x = x + bias.astype(jnp.float32)
    allowed = jnp.ones((1, 1, t, s), bool) if mask is None else mask
    if kind[0]:
        allowed = allowed & jnp.tril(jnp.ones((t, s), bool))
    weights = jax.nn.softmax(jnp.where(allowed, x, jnp.float32(-0.7) * jnp.finfo(jnp.float32).max), axis=-1)
    kept = jnp.unpackbits(keep, axis=-1, count=s, bitorder="little").astype(bool)
    weights = jnp.where(kept, weights * jnp.float32(kind[2]), 0.0)
    return jnp.einsum("bnts,bsnh->btnh", weights.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


def _stock_tangent(tq, tk, tv, tb, q, k, v, bias, mask, keep, *_, scale, kind):
    """The output's tangent, by the stock formula's JVP (the T x S scores in XLA)."""
    f = lambda q, k, v, bias: _reference(q, k, v, bias, mask, keep, scale, kind)  # noqa: E731
    return jax.jvp(f, (q, k, v, bias), (tq, tk, tv, tb.astype(bias.dtype)))[1]


def _stock_grads(q, k, v, bias, mask, keep, o, stats, do, *, scale, kind, want_dbias):
    """The backward call's results by the stock formula's VJP (o and stats unread)."""
    _, vjp = jax.vjp(lambda q, k, v, bias: _reference(q, k, v, bias, mask, keep, scale, kind), q, k, v, bias)
    dq, dk, dv, dbias = vjp(do)
    return dq, dk, dv, dbias if want_dbias else jnp.zeros((0,), jnp.float32)


def _ranks(*args):
    """Every operand's own rank: 4, or 1 for an absent (empty) bias or mask."""
    return tuple(4 if _present(a) else 1 for a in args)


def _in_xla(fn):
    """``fn`` over the leading dims of vmap, for the derivatives computed in XLA."""
    return lambda *args, **params: over_leading(partial(fn, **params), _ranks(*args), *args)


# --- the primitives -------------------------------------------------------------------------
# attention_p: (o, stats) on the kernels. Its JVP is tangent_p, linear in the tangents of q,
# k, v and bias: its value (forward mode) is the tangent call, its transpose (reverse mode)
# the backward call. The derivatives of those two (second order) are the stock formula's, in
# XLA: the kernels have no pass for them. stats are internal (nothing reads a tangent of
# them); o and stats, functions of q, k, v and bias, enter the derivatives through those.

attention_p = define("jb_attention", shapes_of(_forward_ffi), _forward_call, core_ranks=_ranks)
tangent_p = define("jb_attention_tangent", shapes_of(_tangent_ffi, single=True), _tangent_ffi, core_ranks=_ranks,
                   multiple_results=False, partitioned=False)
backward_p = define("jb_attention_backward", shapes_of(_backward_ffi), _backward_call, core_ranks=_ranks)


def _attention(q, k, v, bias, mask, keep, scale, kind):
    """(o, stats): the attention and its rows' softmax statistics."""
    return attention_p.bind(q, k, v, _or_empty(bias, jnp.float32), _or_empty(mask, jnp.bool_),
                            _or_empty(keep, jnp.uint8), scale=scale, kind=kind)


def _attention_jvp(primals, tangents, *, scale, kind):
    q, k, v, bias, mask, keep = primals
    o, stats = attention_p.bind(*primals, scale=scale, kind=kind)
    if all(is_zero(t) for t in tangents[:4]):
        return (o, stats), (zero(o), zero(stats))
    # a zero tangent as zeros (a constant: the transpose computes no gradient for it)
    tq, tk, tv, tb = (jnp.zeros(a.shape, a.dtype) if is_zero(t) else t for a, t in zip(primals[:4], tangents[:4]))
    to = tangent_p.bind(tq, tk, tv, tb, q, k, v, bias, mask, keep, o, stats, scale=scale, kind=kind)
    return (o, stats), (to, zero(stats))


def _tangent_transpose(ct, tq, tk, tv, tb, q, k, v, bias, mask, keep, o, stats, *, scale, kind):
    tangents = (tq, tk, tv, tb)
    if is_zero(ct):
        return [zero_like(t) if undefined(t) else None for t in tangents] + [None] * 8
    want_dbias = undefined(tb) and _present(bias)
    grads = backward_p.bind(q, k, v, bias, mask, keep, o, stats, ct.astype(o.dtype), scale=scale, kind=kind,
                            want_dbias=want_dbias)
    cts = [unbroadcast(g.astype(t.aval.dtype), t.aval.shape) if undefined(t) and (i < 3 or want_dbias) else
           (zero_like(t) if undefined(t) else None) for i, (g, t) in enumerate(zip(grads, tangents))]
    return cts + [None] * 8


def _in_xla_jvp(fn, prim):
    """A JVP rule: the stock formula's, for the derivatives the kernels do not compute (the
    mask and the dropout's bits, integers, have none)."""
    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        floats = [i for i, p in enumerate(primals) if jnp.issubdtype(p.dtype, jnp.floating)]

        def of_floats(*args):
            full = list(primals)
            for i, a in zip(floats, args):
                full[i] = a
            return _in_xla(fn)(*full, **params)

        t_in = [jnp.zeros(primals[i].shape, primals[i].dtype) if is_zero(tangents[i]) else tangents[i] for i in floats]
        _, t_out = jax.jvp(of_floats, [primals[i] for i in floats], t_in)
        return out, t_out
    return jvp


ad.primitive_jvps[attention_p] = _attention_jvp
ad.primitive_transposes[tangent_p] = _tangent_transpose
ad.primitive_jvps[tangent_p] = _in_xla_jvp(_stock_tangent, tangent_p)
ad.primitive_jvps[backward_p] = _in_xla_jvp(_stock_grads, backward_p)
