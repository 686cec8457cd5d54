"""Trace-time argument checks for every op and module: a clear ``TypeError`` / ``ValueError``
naming the function and the argument at fault, before any kernel runs.

Each check takes ``op``, the public name of the caller (``"jb.dense"``, ``"jb.nn.Dense"``),
and the argument's own name, so messages read ``jb.dense: kernel must be (C, K), got ...``.
Nothing here is specific to one layer.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _activations

#: The dtypes the kernels read and write.
KERNEL_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))

#: The dtypes the ops take: the kernels' and float64, which only survives canonicalization
#: with ``jax_enable_x64``; the ops then compute in XLA, in float64, as the stock ops do.
OP_DTYPES = KERNEL_DTYPES + (np.dtype(np.float64),)


def canonical(d) -> np.dtype:
    """``d`` as JAX canonicalizes it: float64 is float32 (int64 int32) unless x64 is on."""
    return np.dtype(jax.dtypes.canonicalize_dtype(d))


def _names(dtypes: Sequence[np.dtype]) -> str:
    # only what can exist now: float64 without x64 is float32, not a dtype of its own
    names = list(dict.fromkeys(canonical(d).name for d in dtypes))
    return " or ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " or " + names[-1]


def array(x: Any, arg: str, op: str, dtypes: Sequence[np.dtype] = KERNEL_DTYPES):
    """``x`` as a JAX array whose canonical dtype is one of ``dtypes`` (a NumPy float64 array
    becomes float32 as in ``jnp.asarray``, unless x64 is on); Python scalars and lists
    become float32."""
    if not hasattr(x, "dtype"):
        try:
            x = jnp.asarray(x, dtype=jnp.float32)
        except (TypeError, ValueError):
            raise TypeError(f"{op}: {arg} must be an array, got {type(x).__name__}") from None
    try:
        d = canonical(x.dtype)
    except (TypeError, ValueError):  # a dtype JAX has no array of (object, str)
        raise TypeError(f"{op}: {arg} must be {_names(dtypes)}, got {x.dtype}") from None
    if d not in dtypes:
        raise TypeError(f"{op}: {arg} must be {_names(dtypes)}, got {x.dtype}")
    return jnp.asarray(x)


def dtype(value: Any, arg: str, op: str, dtypes: Sequence[np.dtype] = KERNEL_DTYPES) -> np.dtype:
    """A dtype argument (``dtype=``, ``out_dtype=``), canonicalized as JAX does, as a numpy
    dtype among ``dtypes``."""
    try:
        d = canonical(np.dtype(value))
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {arg} must be a dtype ({_names(dtypes)}), got {value!r}") from None
    if d not in dtypes:
        raise TypeError(f"{op}: {arg} must be {_names(dtypes)}, got {np.dtype(value)}")
    return d


def compute_dtype(op: str, requested: Any, *arrays, dtypes: Sequence[np.dtype] = KERNEL_DTYPES):
    """The computation dtype: ``requested`` (the ``dtype=`` argument) or, when None, the
    promotion of the arrays' canonical dtypes (as ``jnp.result_type``; None entries skipped)."""
    if requested is not None:
        return dtype(requested, "dtype", op, dtypes)
    d = np.dtype(jnp.result_type(*(a for a in arrays if a is not None)))
    if d not in dtypes:
        raise TypeError(f"{op}: the arguments promote to {d}; the computation dtype must be "
                        f"{_names(dtypes)}")
    return d


def kernel_operand(a, to):
    """``a`` as a kernel takes it: float32 / bfloat16 as it is (the kernels cast between the
    two while re-blocking), anything else (float64 under x64) cast to ``to``."""
    return a if a is None or a.dtype in KERNEL_DTYPES else a.astype(to)


def rank(x, arg: str, op: str, layout: str, *, exactly: int | None = None,
         at_least: int | None = None) -> None:
    """``x.ndim`` is ``exactly`` or at least ``at_least``; ``layout`` (e.g. ``"(..., C)"``)
    says what was expected."""
    ok = (exactly is None or x.ndim == exactly) and (at_least is None or x.ndim >= at_least)
    if not ok:
        want = f"rank {exactly}" if exactly is not None else f"rank >= {at_least}"
        raise ValueError(f"{op}: {arg} must be {layout} ({want}), got shape {tuple(x.shape)}")


def shape(x, arg: str, op: str, expected: tuple, layout: str) -> None:
    """``x.shape == expected``; ``layout`` names the dims (``"(K,)"``)."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{op}: {arg} must have shape {layout} = {tuple(expected)}, "
                         f"got {tuple(x.shape)}")


def same_dtype(op: str, **arrays) -> None:
    """All named arrays share one dtype."""
    dtypes = {name: np.dtype(a.dtype) for name, a in arrays.items() if a is not None}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name} is {d}" for name, d in dtypes.items())
        raise TypeError(f"{op}: {' and '.join(dtypes)} must have one dtype, but {listed}")


def integers(op: str, **values) -> None:
    """Every named value (a stride, a size given as a number) is an int or a NumPy integer,
    as ``lax`` requires: a TypeError, never a truncation, for 1.5 or 2.0, and for a bool."""
    bad = {name: v for name, v in values.items()
           if isinstance(v, bool) or not isinstance(v, (int, np.integer))}
    if bad:
        raise TypeError(f"{op}: " + ", ".join(f"{name} must be an int, got {v!r}"
                                               for name, v in bad.items()))


def positive(op: str, **sizes: int) -> None:
    """Every named size (a stride, a window, a feature count given as an int) is >= 1."""
    bad = {name: v for name, v in sizes.items() if not isinstance(v, (int, np.integer)) or v < 1}
    if bad:
        raise ValueError(f"{op}: " + ", ".join(f"{name} must be a positive int, got {v!r}"
                                               for name, v in bad.items()))


def broadcast(op: str, **leading) -> tuple[int, ...]:
    """The numpy-style broadcast of the named leading shapes, or a ValueError naming them."""
    try:
        return tuple(np.broadcast_shapes(*leading.values()))
    except ValueError:
        listed = ", ".join(f"{name} {tuple(s)}" for name, s in leading.items())
        raise ValueError(f"{op}: the leading dims of {listed} do not broadcast") from None


def activation(value: Any, op: str, arg: str = "activation") -> int:
    """The kernels' code of a fused activation (None or a name of ``_activations.ACTIVATIONS``)."""
    names = sorted(_activations.ACTIVATIONS)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{op}: {arg} must be None or the name of a fused activation, one of "
                        f"{names}; got {value!r}")
    if value is not None and value not in _activations.ACTIVATIONS:
        raise ValueError(f"{op}: unknown {arg} {value!r}; expected None or one of {names}")
    return _activations.code_of(value)
