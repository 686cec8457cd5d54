"""Attention dropout on the kernels: jb.dot_product_attention(..., dropout_rate=,
dropout_rng=, broadcast_dropout=) against flax.linen.dot_product_attention with the same rng
(the same weights dropped), outputs and gradients over odd shapes, masks, biases, causal
and grouped-query heads, bf16, vmap, forward mode and second order; the program keeps no
(B, N, T, S) weights; bad input."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_brgemm as jb
from stock_reference import assert_close, loss

F32, BF16 = jnp.float32, jnp.bfloat16
RNG = jax.random.key(7)


def data(b, t, s, n, k, h, dtype=F32, seed=0):
    rng = np.random.default_rng(seed)
    lead = () if b is None else (b,)
    return tuple(jnp.asarray(rng.standard_normal(lead + shape), dtype) for shape in ((t, n, h), (s, k, h), (s, k, h)))


def flax_attention(q, k, v, bias=None, mask=None, *, rate, rng=RNG, broadcast=True, is_causal=False):
    """Flax's attention with dropout, in float32 on the same (rounded) inputs; grouped-query
    keys and values repeated to the query's heads, the causal limit as a mask."""
    f = lambda a: None if a is None else a.astype(F32)
    group = q.shape[-2] // k.shape[-2]
    k, v = (jnp.repeat(a, group, axis=-2) for a in (k, v))
    if is_causal:
        causal = jnp.tril(jnp.ones((q.shape[-3], k.shape[-3]), bool))
        mask = causal if mask is None else mask & causal
    y = nn.dot_product_attention(f(q), f(k), f(v), f(bias), mask, broadcast_dropout=broadcast, dropout_rng=rng,
                                 dropout_rate=rate, deterministic=False, force_fp32_for_softmax=True)
    return y.astype(q.dtype)


def ours(q, k, v, bias=None, mask=None, *, rate, rng=RNG, broadcast=True, is_causal=False):
    return jb.dot_product_attention(q, k, v, bias, mask, is_causal=is_causal, dropout_rate=rate, dropout_rng=rng,
                                    broadcast_dropout=broadcast)


def check(q, k, v, bias=None, mask=None, **kw):
    """Output and the gradients in q, k, v (and bias) against Flax's, under jit."""
    bf16 = q.dtype == BF16
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)

    def both(f):
        return jax.jit(lambda *a: (f(*a, **kw), jax.grad(loss(f, **kw), argnums)(*a)))

    y, g = both(ours)(q, k, v, bias, mask)
    want, r = both(flax_attention)(q, k, v, bias, mask)
    assert y.dtype == q.dtype and y.shape == q.shape
    assert_close(y, want, 2e-2 if bf16 else 2e-5)
    for gi, ri in zip(g, r):
        assert_close(gi, ri, 5e-2 if bf16 else 1e-4)


# (B, T, S, N, K, H): odd lengths, S not a multiple of 8, grouped-query heads, two key
# chunks (S > 512), sizes of one.
SHAPES = [(2, 5, 7, 2, 1, 8), (1, 33, 17, 4, 4, 20), (2, 17, 45, 6, 2, 64), (1, 40, 600, 2, 2, 24),
          (1, 1, 1, 1, 1, 1), (2, 1, 9, 2, 2, 3), (1, 9, 1, 2, 1, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_shapes(shape, broadcast, causal):
    check(*data(*shape), rate=0.3, broadcast=broadcast, is_causal=causal)


@pytest.mark.parametrize("broadcast", [True, False])
def test_bf16(broadcast):
    check(*data(2, 19, 23, 4, 2, 32, BF16), rate=0.1, broadcast=broadcast, is_causal=True)


@pytest.mark.parametrize("rate", [0.05, 0.5, 0.9])
def test_mask_bias_and_rates(rate):
    q, k, v = data(2, 9, 13, 4, 2, 16)
    rng = np.random.default_rng(1)
    bias = jnp.asarray(rng.standard_normal((1, 4, 9, 13)), F32)
    mask = jnp.asarray(rng.random((2, 1, 9, 13)) > 0.3).at[:, :, 4].set(False)  # a fully masked row
    check(q, k, v, bias, mask, rate=rate, broadcast=False)
    check(q, k, v, bias, mask, rate=rate, is_causal=True)


def test_unbatched():
    q, k, v = data(None, 12, 15, 4, 2, 16)
    check(q, k, v, rate=0.2)
    check(q, k, v, rate=0.2, broadcast=False)


def test_no_dropout_at_rate_zero():
    """Rate 0 drops nothing whatever the rng (as Flax, which skips the dropout)."""
    q, k, v = data(2, 9, 13, 4, 2, 16)
    np.testing.assert_array_equal(jb.dot_product_attention(q, k, v, dropout_rate=0.0, dropout_rng=RNG),
                                  jb.dot_product_attention(q, k, v))


def test_rngs_differ_and_rescale():
    """Different rngs drop different weights; with all values 1 each output is the kept
    fraction of its row times 1 / keep_prob, about 1 on average."""
    q, k, _ = data(4, 64, 256, 4, 4, 16)
    ones = jnp.ones_like(k)
    a, b = (jb.dot_product_attention(q, k, ones, dropout_rate=0.25, dropout_rng=jax.random.key(i),
                                     broadcast_dropout=False) for i in (1, 2))
    assert not np.allclose(a, b)
    assert abs(float(jnp.mean(a)) - 1.0) < 0.02 and float(jnp.std(a)) > 0.01


def test_the_program_keeps_no_weights():
    """The T x S weights are never formed: the gradient's program has the kernels, the bits
    (B, N, T, S / 8) and no products of its own."""
    q, k, v = data(2, 48, 40, 4, 4, 16)
    f = jax.grad(loss(ours, rate=0.1, broadcast=False), (0, 1, 2))
    text = jax.jit(f).lower(q, k, v).as_text()
    assert "jb_attention_fwd" in text and "jb_attention_bwd" in text and "2x4x48x5xui8" in text
    assert "dot_general" not in text


def test_vmap():
    """vmap over a new leading axis with one rng: every element drops the same weights, as a
    loop does."""
    q, k, v = data(2, 10, 12, 4, 2, 16)
    qs = jnp.stack([q, q * 0.5, q + 1.0])
    f = lambda q, k, v: ours(q, k, v, rate=0.4, broadcast=False, is_causal=True)
    ys = jax.jit(jax.vmap(f, in_axes=(0, None, None)))(qs, k, v)
    gs = jax.jit(jax.vmap(jax.grad(loss(f), (0, 1, 2)), in_axes=(0, None, None)))(qs, k, v)
    for i in range(3):
        assert_close(ys[i], flax_attention(qs[i], k, v, rate=0.4, broadcast=False, is_causal=True), 2e-5)
        r = jax.grad(loss(flax_attention, rate=0.4, broadcast=False, is_causal=True), (0, 1, 2))(qs[i], k, v)
        for g, w in zip(gs, r):
            assert_close(g[i], w, 1e-4)


def test_forward_mode_and_second_order():
    q, k, v = data(2, 6, 11, 2, 1, 8)
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 6, 11)), F32)
    tangents = data(2, 6, 11, 2, 1, 8, seed=1) + (jnp.ones_like(bias),)
    kw = dict(rate=0.3, broadcast=False, is_causal=True)
    f, ref = (lambda q, k, v, b: fn(q, k, v, b, **kw) for fn in (ours, flax_attention))
    got = jax.jit(lambda *a: jax.jvp(f, a, tangents))(q, k, v, bias)
    want = jax.jvp(ref, (q, k, v, bias), tangents)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-4)

    def twice(f):
        inner = jax.grad(loss(f), (0, 1, 2, 3))
        return jax.grad(lambda *a: sum(jnp.sum(jnp.cos(g)) for g in inner(*a)), (0, 1, 2, 3))

    for g, w in zip(jax.jit(twice(f))(q, k, v, bias), twice(ref)(q, k, v, bias)):
        assert_close(g, w, 1e-4)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(b=st.integers(1, 2), t=st.integers(1, 40), s=st.integers(1, 70), k=st.integers(1, 2),
       g=st.integers(1, 3), h=st.integers(1, 40), causal=st.booleans(), broadcast=st.booleans(),
       rate=st.floats(0.01, 0.95))
def test_hypothesis_shapes(b, t, s, k, g, h, causal, broadcast, rate):
    check(*data(b, t, s, k * g, k, h, seed=t * 41 + s), rate=rate, broadcast=broadcast, is_causal=causal,
          rng=jax.random.key(s))


def test_bad_input():
    q, k, v = data(2, 5, 7, 4, 2, 8)
    op = "jb.dot_product_attention"
    for rate in (1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)") as info:
            jb.dot_product_attention(q, k, v, dropout_rate=rate, dropout_rng=RNG)
        assert op in str(info.value)
    with pytest.raises(ValueError, match="dropout_rng is required"):
        jb.dot_product_attention(q, k, v, dropout_rate=0.1)
    with pytest.raises(TypeError, match="dropout_rate must be a Python number"):
        jax.jit(lambda r: jb.dot_product_attention(q, k, v, dropout_rate=r, dropout_rng=RNG))(0.1)
