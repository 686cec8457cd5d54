"""jb.brgemm: the batch-reduce GEMM as a differentiable XLA CPU custom call."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _native  # noqa: F401  (registers the FFI targets)
from jax_brgemm.ops._checks import as_kernel_array, broadcast_leading, check_sizes, unbroadcast


def brgemm(a, b, c=None, *, out_dtype=None):
    """Batch-reduce GEMM: ``c + sum_i a[..., i, :, :] @ b[..., i, :, :]``.

    Args:
      a: ``(..., B, M, K)`` float32 or bfloat16.
      b: ``(..., B, K, N)``, same dtype as ``a``.
      c: optional ``(..., M, N)`` accumulator in the output dtype.
      out_dtype: float32 (default; accumulation is always float32) or, for bfloat16
        inputs, bfloat16. Defaults to ``c.dtype`` when ``c`` is given.

    Leading dims broadcast numpy-style. Returns ``(..., M, N)``.
    """
    a = as_kernel_array(a, "a")
    b = as_kernel_array(b, "b")
    if a.dtype != b.dtype:
        raise TypeError(f"brgemm: a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if a.ndim < 3 or b.ndim < 3:
        raise ValueError(f"brgemm: a and b need rank >= 3 ((..., B, M, K) and (..., B, K, N)), "
                         f"got shapes {a.shape} and {b.shape}")
    (nb, m, k), (nb2, k2, n) = a.shape[-3:], b.shape[-3:]
    if nb != nb2 or k != k2:
        raise ValueError(f"brgemm: a {a.shape} and b {b.shape} disagree on the batch B or "
                         f"the reduced size K: expected (..., B, M, K) and (..., B, K, N)")
    check_sizes("brgemm", {"B": nb, "M": m, "K": k, "N": n})
    if out_dtype is None:
        out_dtype = c.dtype if c is not None and hasattr(c, "dtype") else jnp.float32
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise TypeError(f"brgemm: out_dtype must be float32 or bfloat16, got {out_dtype}")
    if a.dtype == jnp.float32 and out_dtype != jnp.float32:
        raise TypeError("brgemm: float32 inputs give a float32 result; out_dtype=bfloat16 "
                        "needs bfloat16 inputs")
    leads = [a.shape[:-3], b.shape[:-3]]
    if c is not None:
        c = as_kernel_array(c, "c")
        if c.dtype != out_dtype:
            raise TypeError(f"brgemm: c has dtype {c.dtype} but the output is {out_dtype}")
        if c.ndim < 2 or c.shape[-2:] != (m, n):
            raise ValueError(f"brgemm: c must be (..., M, N) = (..., {m}, {n}), got {c.shape}")
        leads.append(c.shape[:-2])
    broadcast_leading("brgemm", leads)
    if c is None:
        return _brgemm(a, b, out_dtype)
    return _brgemm_acc(a, b, c, c.shape)


def _call(a, b, c, out_dtype):
    lead = jnp.broadcast_shapes(a.shape[:-3], b.shape[:-3], () if c is None else c.shape[:-2])
    out = jax.ShapeDtypeStruct(lead + (a.shape[-2], b.shape[-1]), out_dtype)
    # expand_dims: vmap hands unbatched operands over with a size-1 leading dim, which the
    # handler broadcasts in place instead of materializing copies.
    if c is None:
        return jax.ffi.ffi_call("jb_brgemm", out, vmap_method="expand_dims")(a, b)
    return jax.ffi.ffi_call("jb_brgemm_acc", out, vmap_method="expand_dims")(a, b, c)


def _grads(a, b, g):
    """Cotangents of a and b for out = sum_i a_i @ b_i; both are BRGEMM calls."""
    g = g.astype(a.dtype)  # bf16 operands take a bf16 cotangent; accumulation stays fp32
    g_shared = g[..., None, None, :, :]  # (..., 1, 1, M, N): shared by every i
    # da_i = g @ b_i^T and db_i = a_i^T @ g: batch-reduce calls with a reduction of one,
    # the i's becoming a leading dim.
    da = _call(g_shared, jnp.swapaxes(b, -1, -2)[..., :, None, :, :], None, a.dtype)
    db = _call(jnp.swapaxes(a, -1, -2)[..., :, None, :, :], g_shared, None, b.dtype)
    return unbroadcast(da, a.shape), unbroadcast(db, b.shape)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _brgemm(a, b, out_dtype):
    return _call(a, b, None, out_dtype)


def _brgemm_fwd(a, b, out_dtype):
    return _call(a, b, None, out_dtype), (a, b)


def _brgemm_bwd(out_dtype, res, g):
    return _grads(*res, g)


_brgemm.defvjp(_brgemm_fwd, _brgemm_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _brgemm_acc(a, b, c, c_shape):
    return _call(a, b, c, c.dtype)


def _brgemm_acc_fwd(a, b, c, c_shape):
    return _call(a, b, c, c.dtype), (a, b)


def _brgemm_acc_bwd(c_shape, res, g):
    a, b = res
    da, db = _grads(a, b, g)
    return da, db, unbroadcast(g, c_shape)


_brgemm_acc.defvjp(_brgemm_acc_fwd, _brgemm_acc_bwd)
