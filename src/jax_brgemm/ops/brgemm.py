"""jb.brgemm: the batch-reduce GEMM as a differentiable XLA CPU custom call."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import ad

from jax_brgemm import _validate as check
from jax_brgemm import precision as _precision
from jax_brgemm.ops import emulation, partitioning
from jax_brgemm.ops.primitive import define, is_zero, unbroadcast, undefined, zero, zero_like

_F32, _BF16, _F64 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(np.float64)


@emulation.exact_on_infinity("a", "b")
def brgemm(a, b, c=None, *, out_dtype=None, precision=None):
    """Batch-reduce GEMM: ``c + sum_i a[..., i, :, :] @ b[..., i, :, :]``.

    Args:
      a: ``(..., B, M, K)`` float32 or bfloat16.
      b: ``(..., B, K, N)``, same dtype as ``a``.
      c: optional ``(..., M, N)`` accumulator in the output dtype.
      out_dtype: float32 (default; accumulation is always float32) or, for bfloat16
        inputs, bfloat16. Defaults to ``c.dtype`` when ``c`` is given.
      precision: the accuracy asked of the products, as ``lax.dot_general`` takes it (a
        ``lax.Precision``, a pair, a ``lax.DotAlgorithmPreset`` or their names; None follows
        ``jax.default_matmul_precision``), met as ``jax_brgemm.precision`` says: exact float32
        products, or bfloat16 ones where it emulates them (AMX; ``ops/emulation.py``). An
        algorithm outside its table is a ValueError.

    Leading dims broadcast numpy-style. Returns ``(..., M, N)``. Any size of 0 (a leading
    dim, B, M, K or N) gives what ``jnp.einsum`` gives, computed in XLA; so does float64
    (which exists with ``jax_enable_x64`` only: a NumPy float64 array is float32 otherwise,
    as JAX canonicalizes it), with a float64 result and ``c``.

    Differentiable to any order in both modes: a primitive whose JVP and transpose are
    BRGEMM calls (the tangent ``da @ b + a @ db`` two of them, accumulating).
    """
    op = "jb.brgemm"
    a = check.array(a, "a", op, check.OP_DTYPES)
    b = check.array(b, "b", op, check.OP_DTYPES)
    check.same_dtype(op, a=a, b=b)
    computed = _precision.computed(_precision.accuracy(precision, op), op)
    check.rank(a, "a", op, "(..., B, M, K)", at_least=3)
    check.rank(b, "b", op, "(..., B, K, N)", at_least=3)
    (nb, m, k), (nb2, k2, n) = a.shape[-3:], b.shape[-3:]
    if nb != nb2 or k != k2:
        raise ValueError(f"{op}: a {a.shape} and b {b.shape} disagree on the batch B or "
                         f"the reduced size K: expected (..., B, M, K) and (..., B, K, N)")
    if c is not None:
        c = check.array(c, "c", op, check.OP_DTYPES)
    out = _out_dtype(op, a.dtype, c, out_dtype)
    leads = {"a": a.shape[:-3], "b": b.shape[:-3]}
    if c is not None:
        check.rank(c, "c", op, f"(..., M, N) = (..., {m}, {n})", at_least=2)
        if c.shape[-2:] != (m, n):
            raise ValueError(f"{op}: c must be (..., M, N) = (..., {m}, {n}), got {c.shape}")
        leads["c"] = c.shape[:-2]
    lead = check.broadcast(op, **leads)
    if 0 in (nb, m, k, n) or 0 in lead or a.dtype == _F64:
        return _brgemm_xla(a, b, c, out)
    # float32 products from bfloat16 ones where the precision asks it (precision.py)
    products = _precision.PRODUCTS[computed] if a.dtype == _F32 else 0
    return brgemm_p.bind(a, b, *(() if c is None else (c,)), out_dtype=out, products=products)


def _out_dtype(op, ab_dtype, c, out_dtype):
    """The result dtype, with the error naming the argument that asked for it."""
    if ab_dtype == _F64:  # x64: computed in XLA, in float64 throughout
        if out_dtype is not None:
            check.dtype(out_dtype, "out_dtype", op, (_F64,))
        if c is not None and c.dtype != _F64:
            raise TypeError(f"{op}: c has dtype {c.dtype}, but float64 a and b give a float64 "
                            f"result; pass c as float64")
        return _F64
    if c is not None and c.dtype == _F64:
        raise TypeError(f"{op}: c must be {np.dtype(ab_dtype).name} or float32 with "
                        f"{np.dtype(ab_dtype).name} a and b, got float64")
    if out_dtype is not None:
        out = check.dtype(out_dtype, "out_dtype", op)
        if ab_dtype == _F32 and out != _F32:
            raise TypeError(f"{op}: float32 a and b give a float32 result; out_dtype=bfloat16 "
                            f"needs bfloat16 a and b")
        if c is not None and c.dtype != out:
            raise TypeError(f"{op}: c has dtype {c.dtype} but out_dtype is {out}; c is the "
                            f"accumulator and must be in the output dtype")
        return out
    if c is None:
        return _F32
    if ab_dtype == _F32 and c.dtype != _F32:
        raise TypeError(f"{op}: c has dtype {c.dtype}, but float32 a and b give a float32 "
                        f"result; pass c as float32")
    return np.dtype(c.dtype)


def _brgemm_xla(a, b, c, out_dtype):
    """What the kernel computes, in XLA: for sizes the kernel does not take (0) and for
    float64."""
    acc = jnp.promote_types(a.dtype, jnp.float32)
    y = jnp.einsum("...bmk,...bkn->...mn", a, b, preferred_element_type=acc)
    if c is not None:
        y = y + c.astype(acc)
    return y.astype(out_dtype)


def _ffi(*operands, out_dtype, products=0):
    a, b = operands[:2]
    c = operands[2] if len(operands) == 3 else None
    lead = jnp.broadcast_shapes(a.shape[:-3], b.shape[:-3], () if c is None else c.shape[:-2])
    out = jax.ShapeDtypeStruct(lead + (a.shape[-2], b.shape[-1]), out_dtype)
    target = "jb_brgemm" if c is None else "jb_brgemm_acc"
    return (jax.ffi.ffi_call(target, out)(*operands, products=np.int64(products)),)


@partitioning.cached
def _target(kinds, out_dtype, products):
    return partitioning.rows(partial(_ffi, out_dtype=out_dtype, products=products), kinds, (partitioning.ROWS,))


def _call(a, b, *c, out_dtype, products):
    """The kernel: ``c + sum_i a_i @ b_i``, float32 operands' products emulated from
    ``products`` bfloat16 ones (ops/emulation.py), 0 exact."""
    operands = (a, b, *c)
    lead = jnp.broadcast_shapes(a.shape[:-3], b.shape[:-3], *(x.shape[:-2] for x in c))
    if not lead:
        return _ffi(*operands, out_dtype=out_dtype, products=products)[0]
    # Batch-partitionable over the first leading dim: operands that have it (not
    # broadcast into it) are split with it; the others are replicated.
    ranks = (a.ndim - 3, b.ndim - 3) + tuple(x.ndim - 2 for x in c)
    kinds = tuple(partitioning.ROWS if r == len(lead) and x.shape[0] == lead[0] else None
                  for x, r in zip(operands, ranks))
    return _target(kinds, np.dtype(out_dtype), products)(*operands)[0]


def _abstract(a, b, *c, out_dtype, products):
    lead = jnp.broadcast_shapes(a.shape[:-3], b.shape[:-3], *(x.shape[:-2] for x in c))
    return ShapedArray(lead + (a.shape[-2], b.shape[-1]), out_dtype)


# ``c + sum_i a_i @ b_i``: bilinear in (a, b), linear in c. Its JVP is the same kernel twice,
# each tangent accumulated into the next call's c; its transpose is batch-reduces with a
# reduction of one (da_i = g @ b_i^T, db_i = a_i^T @ g) and, for c, g itself.
brgemm_p = define("jb_brgemm", _abstract, _call, core_ranks=(3, 3, 2), multiple_results=False)


def _brgemm_jvp(primals, tangents, *, out_dtype, products):
    (a, b, *c), (ta, tb, *tc) = primals, tangents
    out = brgemm_p.bind(a, b, *c, out_dtype=out_dtype, products=products)
    acc = [] if not c or is_zero(tc[0]) else [tc[0]]
    if not is_zero(ta):
        acc = [brgemm_p.bind(ta, b, *acc, out_dtype=out_dtype, products=products)]
    if not is_zero(tb):
        acc = [brgemm_p.bind(a, tb, *acc, out_dtype=out_dtype, products=products)]
    if not acc:
        return out, zero(out)
    return out, jnp.broadcast_to(acc[0], out.shape)


def _brgemm_transpose(g, a, b, *c, out_dtype, products):
    if undefined(a) and undefined(b):
        raise NotImplementedError("jb_brgemm is linear in a or in b, not in both")
    if is_zero(g):
        return [zero_like(x) if undefined(x) else None for x in (a, b, *c)]
    cts = [None, None] + [unbroadcast(g, x.aval.shape) if undefined(x) else None for x in c]
    if undefined(a):
        g_shared = g.astype(a.aval.dtype)[..., None, None, :, :]  # (..., 1, 1, M, N): shared by every i
        da = brgemm_p.bind(g_shared, jnp.swapaxes(b, -1, -2)[..., :, None, :, :], out_dtype=np.dtype(a.aval.dtype),
                           products=products)
        cts[0] = unbroadcast(da, a.aval.shape)
    if undefined(b):
        g_shared = g.astype(b.aval.dtype)[..., None, None, :, :]
        db = brgemm_p.bind(jnp.swapaxes(a, -1, -2)[..., :, None, :, :], g_shared, out_dtype=np.dtype(b.aval.dtype),
                           products=products)
        cts[1] = unbroadcast(db, b.aval.shape)
    return cts


ad.primitive_jvps[brgemm_p] = _brgemm_jvp
ad.primitive_transposes[brgemm_p] = _brgemm_transpose
