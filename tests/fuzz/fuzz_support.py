"""What the fuzz tests share: the settings profiles, random arguments of any dtype, the
expected refusals and the comparisons.

Profiles: in CI every property runs a few derandomized examples (the whole folder in
well under a minute). ``JB_FUZZ_EXAMPLES=N`` runs N random examples per property instead
(``JB_FUZZ_EXAMPLES=400 pytest -q tests/fuzz``), printing a reproduction blob on failure.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st

LONG_EXAMPLES = int(os.environ.get("JB_FUZZ_EXAMPLES", "0"))


def profile(ci_examples: int):
    """The settings of one property: ``ci_examples`` derandomized examples, or the long
    profile's random ones."""
    # no explain phase: it re-runs a failing example hundreds of times, minutes here
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
    common = dict(deadline=None, suppress_health_check=list(HealthCheck), phases=phases)
    if LONG_EXAMPLES:
        return settings(max_examples=LONG_EXAMPLES, derandomize=False, print_blob=True, **common)
    return settings(max_examples=ci_examples, derandomize=True, database=None, **common)


#: Argument dtypes as a user hands them over: JAX arrays, NumPy float64 (NumPy's default,
#: canonicalized by JAX) and dtypes the kernels do not take.
DTYPES = ["float32", "bfloat16", "float64", "float16", "int32"]
#: What the ops take; float64 exists (as itself) under x64 only.
OP_DTYPES = ("float32", "bfloat16", "float64")
KERNEL_DTYPES = ("float32", "bfloat16")


def mostly(common, *rare, times=4):
    """``common`` values ``times`` as often as each ``rare`` one: most examples valid, the
    faults and edge cases in a fair share of them."""
    return st.sampled_from(list(common) * times + list(rare))


# Mostly float32; the others often enough to be seen in a few examples.
dtypes = mostly(["float32", "float32", "bfloat16", "float64"], "float16", "int32")
kernel_friendly = st.sampled_from(["float32", "float32", "bfloat16", "float64"])
activations = st.sampled_from([None, "relu", "gelu", "sigmoid", "tanh"])
x64_modes = mostly([False], True, times=5)


def sizes(hi: int):
    """A size in 1..hi, or 0 now and then."""
    return mostly(range(1, hi + 1), 0, times=2)

REF_ACT = {None: lambda v: v, "relu": jax.nn.relu, "gelu": lambda v: jax.nn.gelu(v, approximate=True),
           "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}


def make(rng: np.random.Generator, shape, dtype: str, scale=1.0):
    """An argument of ``shape``: NumPy float64 for "float64" (so that JAX canonicalizes it),
    a JAX array otherwise."""
    shape = tuple(shape)
    if dtype == "int32":
        return jnp.asarray(rng.integers(-2, 3, shape), jnp.int32)
    values = scale * rng.standard_normal(shape)
    return values if dtype == "float64" else jnp.asarray(values, dtype)


def canonical(a) -> str:
    return np.dtype(jax.dtypes.canonicalize_dtype(np.asarray(a).dtype if isinstance(a, np.ndarray)
                                                  else a.dtype)).name


def first_bad(allowed, **args) -> str | None:
    """The first named argument (in the op's check order) whose canonical dtype is not one
    of ``allowed``."""
    for name, a in args.items():
        if a is not None and canonical(a) not in allowed:
            return name
    return None


def promoted(*arrays) -> np.dtype:
    return np.dtype(jnp.result_type(*(jnp.asarray(a) for a in arrays if a is not None)))


def accumulation(dtype) -> np.dtype:
    """float32 for the kernels' dtypes, float64 for float64."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def tolerance(dtype, depth=1) -> float:
    """A relative tolerance for a result computed in ``dtype`` through ``depth`` chained
    roundings (LSTM steps)."""
    base = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}[np.dtype(dtype).name]
    return base * depth


def assert_close(got, want, tol):
    """Same tree, shapes and dtypes; values within ``tol`` of the largest magnitude."""
    sizes = [np.size(a) for a in jax.tree_util.tree_leaves(want)]
    event("compared: " + ("empty" if not any(sizes) else np.dtype(jax.tree_util.tree_leaves(want)[0].dtype).name))
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        # a leaf is only as precise as its own dtype (a float32 gradient of a float64 loss)
        leaf_tol = max(tol, tolerance(g.dtype)) if jnp.issubdtype(g.dtype, jnp.floating) else tol
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = 1.0 + (np.max(np.abs(w[np.isfinite(w)])) if np.isfinite(w).any() else 0.0)
        np.testing.assert_allclose(g, w, rtol=leaf_tol, atol=leaf_tol * scale)


def expect_refusal(call, kinds, *names):
    """``call()`` raises one of ``kinds`` whose message names every one of ``names``."""
    with pytest.raises(kinds) as info:
        call()
    event(f"refused: {type(info.value).__name__}")
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def stock_outcome(call):
    """``(result, None)`` or ``(None, the exception)`` of the stock computation."""
    try:
        return jax.block_until_ready(call()), None
    except Exception as e:  # noqa: BLE001 -- any refusal by stock is a refusal
        return None, e


def weights(rng, tree):
    """A fixed random cotangent per leaf: a loss sum(w * y) with every output weighed."""
    return jax.tree_util.tree_map(lambda y: jnp.asarray(rng.standard_normal(y.shape), jnp.float32), tree)


def weighed_sum(tree, w):
    return sum(jnp.sum(y.astype(jnp.float32) * v) for y, v in
               zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(w), strict=True))
