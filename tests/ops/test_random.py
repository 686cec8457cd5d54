"""jb.ops.random: dropout's keep-masks on the kernels equal jax.random.bernoulli's bit for
bit (typed and raw threefry keys, odd shapes, every p), packed or not, under jit and vmap;
what does not hash like JAX falls back to JAX; accelerate() routes flax's Dropout to it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_brgemm as jb
from jax_brgemm.ops import random

SHAPES = [(), (1,), (7,), (3, 13), (2, 5, 64), (4, 3, 33, 65), (1, 1, 128, 128)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0 / 3.0, 1.0])
def test_bernoulli_is_jax_bit_for_bit(shape, p):
    for key in (jax.random.key(11), jax.random.PRNGKey(12)):
        want = jax.random.bernoulli(key, p, shape)
        got = jax.jit(lambda k: random.bernoulli(k, p, shape))(key)
        assert got.dtype == jnp.bool_ and got.shape == shape
        np.testing.assert_array_equal(got, want)
        if shape:
            bits = jax.jit(lambda k: random.bernoulli_bits(k, p, shape))(key)
            np.testing.assert_array_equal(bits, jnp.packbits(want, axis=-1, bitorder="little"))


def test_on_the_kernels_and_under_vmap():
    key = jax.random.key(3)
    assert "jb_bernoulli" in jax.jit(lambda k: random.bernoulli(k, 0.9, (8, 16))).lower(key).as_text()
    keys = jax.random.split(key, 3)
    got = jax.jit(jax.vmap(lambda k: random.bernoulli_bits(k, 0.7, (5, 20))))(keys)
    for i in range(3):
        np.testing.assert_array_equal(got[i], jnp.packbits(jax.random.bernoulli(keys[i], 0.7, (5, 20)), axis=-1,
                                                           bitorder="little"))


def test_what_hashes_otherwise_is_jax():
    rbg = jax.random.key(5, impl="rbg")
    assert not random.hashes_like_jax(rbg, 0.5)
    np.testing.assert_array_equal(random.bernoulli(rbg, 0.5, (4, 9)), jax.random.bernoulli(rbg, 0.5, (4, 9)))
    f = jax.jit(lambda k, p: random.bernoulli(k, p, (4, 9)))  # p traced: jax's own
    assert "jb_bernoulli" not in f.lower(jax.random.key(1), 0.5).as_text()
    np.testing.assert_array_equal(f(jax.random.key(1), 0.5), jax.random.bernoulli(jax.random.key(1), 0.5, (4, 9)))


@pytest.mark.parametrize("broadcast_dims", [(), (1,)])
def test_flax_dropout_under_accelerate(broadcast_dims):
    """linen's and NNX's Dropout drop the same elements inside a context, their masks drawn on
    the kernels; jax.random.bernoulli is jax's own again after it."""
    stock = jax.random.bernoulli
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 37, 24)), jnp.float32)
    drop = nn.Dropout(0.3, broadcast_dims=broadcast_dims, deterministic=False)
    f = jax.jit(lambda x: drop.apply({}, x, rngs={"dropout": jax.random.key(2)}))
    want = f(x)
    with jb.accelerate() as acc:
        got = f(x)
        text = f.lower(x).as_text()
        layer = nnx.Dropout(0.3, broadcast_dims=broadcast_dims, rngs=nnx.Rngs(dropout=4))
        twin = nnx.clone(layer)
        nnx_got = layer(x)
    np.testing.assert_array_equal(got, want)
    assert "jb_bernoulli" in text and [(c.layer, c.accelerated) for c in acc.calls] == [("jax.random.bernoulli", True)]
    np.testing.assert_array_equal(nnx_got, twin(x))
    assert jax.random.bernoulli is stock
