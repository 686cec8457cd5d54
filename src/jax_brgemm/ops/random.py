"""Dropout's keep-masks on the cores: ``jax.random.bernoulli(key, p, shape)``, bit for bit.

JAX hashes each element's index with threefry2x32 and compares 23 of the bits with ``p``;
XLA's CPU lowering runs the hash's rounds as a loop over whole arrays (~8 ns per element on
one core). ``jb_bernoulli`` (``cpp/layers/common/random.h``) computes the same hash per
element, vectorized, on every core, as bytes (``bernoulli``) or as bits packed along the last
axis (``bernoulli_bits``, what the attention kernels read).

The same bits as JAX's hold for its default generator: ``threefry2x32`` keys (typed or raw),
``jax_threefry_partitionable`` on (JAX's default), a float32 ``p`` known at trace time
(``jax_enable_x64`` off) and the default ``mode="low"``. For anything else both functions
are ``jax.random.bernoulli`` itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _native  # noqa: F401  (registers the FFI targets)

__all__ = ["bernoulli", "bernoulli_bits", "hashes_like_jax"]

# jax's own function, as imported (accelerate() may route jax.random.bernoulli here)
_STOCK_BERNOULLI = jax.random.bernoulli


def hashes_like_jax(key, p) -> bool:
    """Whether ``jb_bernoulli`` draws what ``jax.random.bernoulli(key, p, ...)`` draws."""
    if jax.config.jax_enable_x64 or not jax.config.jax_threefry_partitionable:
        return False
    try:
        p = float(p)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return False
    if not hasattr(key, "dtype") or key.shape not in ((), (2,)):
        return False
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.shape == () and str(jax.random.key_impl(key)) == "threefry2x32"
    return key.shape == (2,) and key.dtype == jnp.uint32 and jax.config.jax_default_prng_impl == "threefry2x32"


def _key_words(key):
    return jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key


def _threshold(p) -> np.int64:
    """The keep test's bound (layers/common/random.h): uniform m * 2^-23 < p iff m < this."""
    p32 = float(np.float32(p))
    return np.int64(min(max(np.ceil(p32 * 2.0 ** 23), 0), 2 ** 23)) if p32 == p32 else np.int64(0)


def bernoulli(key, p, shape):
    """``jax.random.bernoulli(key, p, shape)``: the same booleans, drawn on the kernels where
    ``hashes_like_jax(key, p)``."""
    shape = tuple(int(d) for d in shape)
    if not hashes_like_jax(key, p) or 0 in shape:
        return _STOCK_BERNOULLI(key, p, shape)
    out = jax.ShapeDtypeStruct(shape, jnp.bool_)
    return jax.ffi.ffi_call("jb_bernoulli", out, vmap_method="sequential")(
        _key_words(key), threshold=_threshold(p), cols=np.int64(0))


def bernoulli_bits(key, p, shape):
    """``jnp.packbits(jax.random.bernoulli(key, p, shape), axis=-1, bitorder="little")``:
    the mask as bits along its last axis (``ceil(shape[-1] / 8)`` bytes per row)."""
    shape = tuple(int(d) for d in shape)
    if not hashes_like_jax(key, p) or 0 in shape or not shape:
        return jnp.packbits(_STOCK_BERNOULLI(key, p, shape), axis=-1, bitorder="little")
    out = jax.ShapeDtypeStruct(shape[:-1] + (-(-shape[-1] // 8),), jnp.uint8)
    return jax.ffi.ffi_call("jb_bernoulli", out, vmap_method="sequential")(
        _key_words(key), threshold=_threshold(p), cols=np.int64(shape[-1]))
