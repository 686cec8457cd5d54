"""jb.dot_product_attention: scaled dot-product attention as BRGEMM custom calls with a
custom VJP.

Two XLA FFI calls into ``cpp/layers/attention`` (flash-style: the T x S scores are never
stored, a query block keeps one tile of them):

* ``jb_attention_fwd``: ``softmax(scale * q k^T + bias, masked) v`` per query block, over key
  chunks with an online softmax; it also returns each row's max and sum (float32), all the
  backward needs besides the inputs and the output.
* ``jb_attention_bwd``: dq, dk and dv in one pass (P and dP recomputed per chunk from the
  saved statistics), and, when the bias is differentiated, the gradient of a full
  ``(B, N, T, S)`` bias, summed here over the dims the bias broadcasts along.

Second and higher derivatives go through the stock formula: the backward call is itself a
``custom_vjp`` function whose VJP is that of ``jax.nn.dot_product_attention``'s VJP, so
``jax.grad`` of ``jax.grad`` is exact (not on the kernels). Forward mode (``jax.jvp``) is not
supported, as for every ``custom_vjp`` function.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jax_brgemm import _native  # noqa: F401  (registers the FFI targets)
from jax_brgemm import _validate as check
from jax_brgemm import precision as _precision
from jax_brgemm.ops import emulation, partitioning

_FLOATS = (*check.KERNEL_DTYPES, np.dtype(np.float16), np.dtype(np.float64))


@emulation.exact_on_infinity("query", "key", "value")
def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          precision=None):
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

    # Nothing for the kernels (a size of 0: an empty or zero result), or float64 (x64): stock.
    if 0 in (b, t, n, h, s) or np.dtype(q.dtype) == np.dtype(np.float64):
        return jax.nn.dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=causal)
    bias4 = None if bias is None else bias.astype(jnp.float32)
    # bfloat16 inputs are exact in one product whatever the precision
    products = _precision.PRODUCTS[computed] if q.dtype == jnp.float32 else 0
    o, _ = _attention(q, k, v, bias4, mask, scale, (causal, products))
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


def _scale(scale, h, op):
    if scale is None:
        return 1.0 / math.sqrt(h) if h else 1.0
    try:
        return float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"{op}: scale must be a Python number (static), got {scale!r}") from None


# --- the custom calls --------------------------------------------------------------------
# vmap_method="expand_dims": under vmap every operand gets the mapped dims in front (size 1
# when unmapped); the handlers fold them into the batch and read unmapped operands in place.
# Each call is batch-partitionable (partitioning.rows): under jit with the batch B sharded,
# it runs per shard; a bias or mask broadcast over B is replicated, and the gradient of
# such a bias is a per-shard partial sum, psum'ed.


def _or_empty(a, dtype):
    return jnp.zeros((0,), dtype) if a is None else a


def _forward_ffi(q, k, v, bias, mask, *, scale, kind):
    b, t, n, _ = q.shape
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t, 2), jnp.float32))
    return tuple(jax.ffi.ffi_call("jb_attention_fwd", outs, vmap_method="expand_dims")(
        q, k, v, bias, mask, scale=np.float32(scale), **_attrs(kind)))


def _attrs(kind):
    """The FFI attributes of ``kind``: (is_causal, the bfloat16 products each product is
    emulated from, 0: exact float32)."""
    causal, products = kind
    return {"causal": bool(causal), "products": np.int64(products)}


def _backward_ffi(q, k, v, bias, mask, o, stats, do, *, scale, kind, want_dbias):
    b, t, n, _ = q.shape
    full = (b, n, t, k.shape[1])
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(full if want_dbias else (0,), jnp.float32))
    dq, dk, dv, dbias = jax.ffi.ffi_call("jb_attention_bwd", outs, vmap_method="expand_dims")(
        q, k, v, bias, mask, o, stats, do, scale=np.float32(scale), **_attrs(kind))
    if want_dbias:  # back to the bias's shape: summed over the dims it broadcasts along
        axes = tuple(i for i, (d, f) in enumerate(zip(bias.shape, full)) if d == 1 and f != 1)
        dbias = jnp.sum(dbias, axis=axes, keepdims=True) if axes else dbias
    return dq, dk, dv, dbias


_R, _SUM = partitioning.ROWS, partitioning.SUM


def _batch_kind(a, b):
    """Split a bias or mask with the batch when it has the batch's B; else replicate it."""
    return _R if a is not None and a.shape[0] == b else None


@partitioning.cached
def _forward_target(scale, kind, bias_kind, mask_kind):
    return partitioning.rows(partial(_forward_ffi, scale=scale, kind=kind),
                             (_R, _R, _R, bias_kind, mask_kind), (_R, _R))


@partitioning.cached
def _backward_target(scale, kind, want_dbias, bias_kind, mask_kind):
    # A bias shared by the batch gets every shard's contribution to its gradient: a sum.
    return partitioning.rows(
        partial(_backward_ffi, scale=scale, kind=kind, want_dbias=want_dbias),
        (_R, _R, _R, bias_kind, mask_kind, _R, _R, _R), (_R, _R, _R, bias_kind or _SUM))


def _forward_call(q, k, v, bias, mask, scale, kind):
    b = q.shape[0]
    target = _forward_target(scale, kind, _batch_kind(bias, b), _batch_kind(mask, b))
    return target(q, k, v, _or_empty(bias, jnp.float32), _or_empty(mask, jnp.bool_))


def _backward_call(q, k, v, bias, mask, o, stats, do, scale, kind, want_dbias):
    b = q.shape[0]
    target = _backward_target(scale, kind, want_dbias, _batch_kind(bias, b), _batch_kind(mask, b))
    dq, dk, dv, dbias = target(q, k, v, _or_empty(bias, jnp.float32), _or_empty(mask, jnp.bool_),
                               o, stats, do)
    return dq, dk, dv, dbias if want_dbias else None


def _reference(q, k, v, bias, mask, scale, kind):
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, is_causal=kind[0])


# --- the differentiable functions ----------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, bias, mask, scale, kind):
    """(o, stats): the attention and its rows' softmax statistics."""
    return _forward_call(q, k, v, bias, mask, scale, kind)


def _attention_fwd(q, k, v, bias, mask, scale, kind):
    # symbolic_zeros: arguments come as CustomVJPPrimal(value, perturbed). The bias gradient
    # (a full (B, N, T, S) array before its reduction) is computed only when it is needed.
    want_dbias = bias is not None and bias.perturbed
    q, k, v = q.value, k.value, v.value
    bias = None if bias is None else bias.value
    mask = None if mask is None else mask.value
    o, stats = _attention(q, k, v, bias, mask, scale, kind)  # differentiable for an outer grad
    return (o, stats), (q, k, v, bias, mask, o, stats, () if want_dbias else None)


def _attention_bwd(scale, kind, res, cotangents):
    q, k, v, bias, mask, o, stats, want = res
    do = cotangents[0]  # the statistics are internal: nothing differentiates them
    if isinstance(do, SymbolicZero):
        do = jnp.zeros(o.shape, o.dtype)
    dq, dk, dv, dbias = _grads(q, k, v, bias, mask, o, stats, do.astype(o.dtype), scale, kind,
                               want is not None)
    return dq, dk, dv, dbias, None


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


@partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _grads(q, k, v, bias, mask, o, stats, do, scale, kind, want_dbias):
    """(dq, dk, dv, dbias or None) of the attention at (q, k, v, bias) for the cotangent do;
    o and stats are the forward's results there."""
    return _backward_call(q, k, v, bias, mask, o, stats, do, scale, kind, want_dbias)


def _grads_fwd(q, k, v, bias, mask, o, stats, do, scale, kind, want_dbias):
    out = _grads(q, k, v, bias, mask, o, stats, do, scale, kind, want_dbias)
    return out, (q, k, v, bias, mask, o, stats, do)


def _grads_bwd(scale, kind, want_dbias, res, cotangents):
    # The derivative of the gradients, from the stock formula's VJP. o and stats are functions
    # of (q, k, v, bias): their dependence is inside the derivative taken here, so they get 0.
    q, k, v, bias, mask, o, stats, do = res
    gq, gk, gv, gbias = cotangents

    def first_order(q, k, v, bias, do):
        _, vjp = jax.vjp(lambda q, k, v, bias: _reference(q, k, v, bias, mask, scale, kind), q, k, v, bias)
        return vjp(do)

    _, vjp2 = jax.vjp(first_order, q, k, v, bias, do)
    if bias is not None and not want_dbias:
        gbias = jnp.zeros(bias.shape, bias.dtype)
    d_q, d_k, d_v, d_bias, d_do = vjp2((gq, gk, gv, gbias))
    return d_q, d_k, d_v, d_bias, None, jnp.zeros_like(o), jnp.zeros_like(stats), d_do


_grads.defvjp(_grads_fwd, _grads_bwd)
