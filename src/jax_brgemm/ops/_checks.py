"""Trace-time argument checks shared by the ops: clear Python errors before any kernel runs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

KERNEL_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def as_kernel_array(x, name: str):
    """x as a JAX array of a dtype the kernels support (float32 or bfloat16)."""
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x, dtype=jnp.float32)
    if np.dtype(x.dtype) not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float32 or bfloat16, got {x.dtype}")
    return jnp.asarray(x)


def check_sizes(op: str, sizes: dict[str, int]) -> None:
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise ValueError(f"{op}: sizes must be >= 1, got " + ", ".join(f"{k}={v}" for k, v in bad.items()))


def broadcast_leading(op: str, leads) -> tuple[int, ...]:
    """The broadcast of the operands' leading dims, or a ValueError naming them."""
    try:
        return tuple(np.broadcast_shapes(*leads))
    except ValueError:
        raise ValueError(f"{op}: leading dims {', '.join(map(str, leads))} do not broadcast") from None


def unbroadcast(x, shape):
    """Sums x over the dims that broadcasting added or expanded, back to `shape`."""
    extra = x.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        extra + i for i, s in enumerate(shape) if s == 1 and x.shape[extra + i] != 1)
    return jnp.sum(x, axis=axes).reshape(shape) if axes else x
