"""jb.dot_product_attention against jax.nn.dot_product_attention: outputs and gradients over
sequence lengths, head dims, grouped-query heads, causal masking, masks, biases, fully masked
rows, dtypes, vmap, jit, higher derivatives, NaN propagation and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_brgemm as jb
from stock_reference import loss, assert_close

F32, BF16 = jnp.float32, jnp.bfloat16


def data(b, t, s, n, k, h, dtype=F32, seed=0, unbatched=False):
    rng = np.random.default_rng(seed)
    lead = () if unbatched else (b,)
    q = jnp.asarray(rng.standard_normal(lead + (t, n, h)), dtype)
    kk = jnp.asarray(rng.standard_normal(lead + (s, k, h)), dtype)
    v = jnp.asarray(rng.standard_normal(lead + (s, k, h)), dtype)
    return q, kk, v


def reference(q, k, v, bias=None, mask=None, **kw):
    """jax.nn.dot_product_attention in float32 on the same (rounded) inputs."""
    f = lambda a: None if a is None else a.astype(F32)
    return jax.nn.dot_product_attention(f(q), f(k), f(v), f(bias), mask, **kw).astype(q.dtype)


def value_and_grads(f, argnums, **kw):
    """jit(output, gradients of loss(f)) in one compilation."""
    def both(*args):
        return f(*args, **kw), jax.grad(loss(f, **kw), argnums)(*args)
    return jax.jit(both)


def check(q, k, v, bias=None, mask=None, tol=None, grad_tol=None, **kw):
    """Output and the gradients in q, k, v (and bias) against the reference."""
    bf16 = q.dtype == BF16
    tol = tol or (2e-2 if bf16 else 2e-5)
    grad_tol = grad_tol or (5e-2 if bf16 else 1e-4)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    y, g = value_and_grads(jb.dot_product_attention, argnums, **kw)(q, k, v, bias, mask)
    want, r = value_and_grads(reference, argnums, **kw)(q, k, v, bias, mask)
    assert y.dtype == q.dtype and y.shape == q.shape
    assert_close(y, want, tol)
    for gi, ri, arg in zip(g, r, (q, k, v, bias)):
        assert gi.dtype == arg.dtype and gi.shape == arg.shape
        assert_close(gi, ri, grad_tol)


# (B, T, S, N, K, H): odd and unequal lengths, head dims 8..128 (multiples of 16 and not),
# grouped-query and multi-query heads, two key chunks (S > 512).
SHAPES = [(2, 5, 7, 2, 1, 8), (1, 33, 17, 4, 4, 20), (2, 17, 33, 6, 2, 64), (3, 70, 70, 2, 2, 33),
          (1, 129, 130, 3, 1, 16), (2, 64, 64, 4, 4, 128), (1, 40, 600, 2, 2, 24), (2, 197, 197, 2, 2, 72)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_shapes(shape, causal):
    check(*data(*shape), is_causal=causal)


@pytest.mark.parametrize("shape", [(2, 19, 23, 4, 2, 32), (1, 64, 64, 2, 2, 64), (2, 9, 130, 2, 1, 12)])
@pytest.mark.parametrize("causal", [False, True])
def test_bf16(shape, causal):
    check(*data(*shape, dtype=BF16), is_causal=causal)


@pytest.mark.parametrize("bias_shape", [(2, 4, 9, 13), (1, 4, 9, 13), (9, 13), (2, 1, 1, 13), (4, 9, 1),
                                        (1, 1, 1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_bias(bias_shape, causal):
    q, k, v = data(2, 9, 13, 4, 2, 16)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal(bias_shape), F32)
    check(q, k, v, bias, is_causal=causal)


@pytest.mark.parametrize("mask_shape", [(2, 4, 9, 13), (1, 1, 9, 13), (2, 1, 1, 13), (9, 1), (1, 4, 1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_mask(mask_shape, causal):
    q, k, v = data(2, 9, 13, 4, 2, 16)
    mask = jnp.asarray(np.random.default_rng(2).random(mask_shape) > 0.3)
    check(q, k, v, None, mask, is_causal=causal)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows(dtype, causal):
    """Rows with every key masked attend uniformly to all keys, as in jax (which masks with a
    large negative, not -inf); their logits get no gradient."""
    q, k, v = data(2, 11, 13, 4, 2, 16, dtype)
    mask = np.random.default_rng(3).random((2, 4, 11, 13)) > 0.3
    mask[:, :, ::3] = False
    mask[1, 2, 5] = False
    bias = jnp.asarray(np.random.default_rng(4).standard_normal((1, 4, 11, 13)), dtype)
    check(q, k, v, bias, jnp.asarray(mask), is_causal=causal)
    y = jb.dot_product_attention(q, k, v, mask=jnp.asarray(mask))
    uniform = jnp.mean(v.astype(F32), axis=1)  # (B, K, H); head n uses kv head n // 2
    assert_close(y[:, 0, :, :], jnp.repeat(uniform, 2, axis=1), 2e-2 if dtype == BF16 else 1e-5)


def test_bias_gradient_dtype_and_broadcast():
    q, k, v = data(2, 9, 13, 4, 2, 16)
    for dtype in (F32, BF16, jnp.float16):
        bias = jnp.asarray(np.random.default_rng(5).standard_normal((4, 1, 13)), dtype)
        check(q, k, v, bias, grad_tol=3e-2 if dtype != F32 else None)


def test_constant_bias_skips_its_gradient():
    """A bias that is not differentiated (an additive mask) costs no (B, N, T, S) gradient."""
    q, k, v = data(2, 9, 13, 4, 2, 16)
    bias = jnp.zeros((2, 1, 1, 13), F32).at[:, :, :, 10:].set(-1e9)
    text = jax.jit(jax.grad(lambda q: jnp.sum(jb.dot_product_attention(q, k, v, bias)))).lower(q).as_text()
    assert "jb_attention_bwd" in text and "2x4x9x13xf32" not in text
    text = jax.jit(jax.grad(lambda b: jnp.sum(jb.dot_product_attention(q, k, v, b)))).lower(bias).as_text()
    assert "2x4x9x13xf32" in text


def test_unbatched_and_scale():
    q, k, v = data(1, 12, 15, 4, 1, 16, unbatched=True)
    check(q, k, v, scale=0.3)
    check(q, k, v, jnp.ones((4, 12, 15)), scale=-0.5, is_causal=True)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_sizes_of_one(dtype):
    check(*data(1, 1, 1, 1, 1, 1, dtype))
    check(*data(1, 1, 5, 1, 1, 3, dtype), is_causal=True)
    check(*data(3, 4, 1, 2, 1, 1, dtype), is_causal=True)


def test_zero_sizes():
    for shape in [(0, 3, 4, 2, 1, 8), (2, 0, 4, 2, 1, 8), (2, 3, 0, 2, 1, 8)]:
        q, k, v = data(*shape)
        y = jb.dot_product_attention(q, k, v)
        assert y.shape == q.shape
        np.testing.assert_array_equal(y, jax.nn.dot_product_attention(q, k, v))


def test_numpy_float64_and_x64():
    """NumPy float64 inputs are float32 as JAX canonicalizes them; with x64 on, float64
    computes in float64 as jax.nn.dot_product_attention does (in XLA)."""
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((2, 5, 2, 8)), rng.standard_normal((2, 6, 1, 8)), rng.standard_normal((2, 6, 1, 8))
    bias = rng.standard_normal((5, 6))
    y = jb.dot_product_attention(q, k, v, bias, is_causal=True)
    assert y.dtype == F32
    assert_close(y, reference(*(jnp.asarray(a) for a in (q, k, v, bias)), is_causal=True), 2e-5)
    with jax.enable_x64(True):
        y = jb.dot_product_attention(q, k, v, bias, is_causal=True)
        want = jax.nn.dot_product_attention(q, k, v, bias, is_causal=True)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
        q32, k32, v32 = (jnp.asarray(a, F32) for a in (q, k, v))
        assert "jb_attention_fwd" in jax.jit(jb.dot_product_attention).lower(q32, k32, v32).as_text()


def test_vmap():
    """vmap over a new leading axis: batched queries against shared or batched keys, with a
    shared mask; values and gradients match a Python loop."""
    q, k, v = data(3, 10, 12, 4, 2, 16)
    qs = jnp.stack([q, q * 0.5, q + 1.0])
    mask = jnp.asarray(np.random.default_rng(6).random((1, 1, 10, 12)) > 0.2)
    f = lambda q, k, v: jb.dot_product_attention(q, k, v, mask=mask, is_causal=True)
    ys = jax.jit(jax.vmap(f, in_axes=(0, None, None)))(qs, k, v)
    for i in range(3):
        assert_close(ys[i], reference(qs[i], k, v, mask=mask, is_causal=True), 2e-5)
    ks, vs = jnp.stack([k, -k, k * 2]), jnp.stack([v, v, -v])
    g = jax.jit(jax.vmap(jax.grad(loss(jb.dot_product_attention), (0, 1, 2))))(qs, ks, vs)
    r = jax.jit(jax.vmap(jax.grad(loss(reference), (0, 1, 2))))(qs, ks, vs)
    for gi, ri in zip(g, r):
        assert_close(gi, ri, 1e-4)


def test_grad_of_grad():
    q, k, v = data(2, 6, 7, 2, 1, 8)
    bias = jnp.asarray(np.random.default_rng(7).standard_normal((1, 2, 6, 7)), F32)

    def twice(f):
        inner = jax.grad(loss(f, is_causal=True), (0, 1, 2, 3))
        return jax.grad(lambda q, k, v, b: sum(jnp.sum(jnp.cos(g)) for g in inner(q, k, v, b)), (0, 1, 2, 3))

    got = jax.jit(twice(jb.dot_product_attention))(q, k, v, bias)
    want = jax.jit(twice(reference))(q, k, v, bias)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-4)


def test_nan_propagates():
    q, k, v = data(1, 4, 5, 1, 1, 8)
    q = q.at[0, 2, 0, 3].set(jnp.nan)
    y = np.asarray(jb.dot_product_attention(q, k, v))
    assert np.isnan(y[0, 2]).all()
    assert not np.isnan(y[0, [0, 1, 3]]).any()
    assert_close(y[0, [0, 1, 3]], reference(q, k, v)[0, [0, 1, 3]], 2e-5)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(b=st.integers(1, 2), t=st.integers(1, 40), s=st.integers(1, 40), k=st.integers(1, 2),
       g=st.integers(1, 3), h=st.integers(1, 40), causal=st.booleans(), masked=st.booleans())
def test_hypothesis_shapes(b, t, s, k, g, h, causal, masked):
    q, kk, v = data(b, t, s, k * g, k, h, seed=t * 41 + s)
    mask = jnp.asarray(np.random.default_rng(s).random((b, 1, t, s)) > 0.25) if masked else None
    check(q, kk, v, None, mask, is_causal=causal)


def test_bad_input():
    q, k, v = data(2, 5, 7, 4, 2, 8)
    op = "jb.dot_product_attention"
    cases = [
        ((q[0, 0], k, v), {}, ValueError, "query must be"),
        ((q, k[..., :4], v[..., :4]), {}, ValueError, "head dim"),
        ((q, k, v[:, :6]), {}, ValueError, "value must have key's shape"),
        ((q, k[:1], v[:1]), {}, ValueError, "batch"),
        ((q[:, :, :3], k, v), {}, ValueError, "must divide the query heads"),
        ((q, k.astype(BF16), v), {}, TypeError, "query and key and value must have one dtype"),
        ((q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16)), {}, TypeError,
         "query must be float32 or bfloat16"),
        ((q, k, v, jnp.zeros((2, 4, 5, 6))), {}, ValueError, "bias (2, 4, 5, 6) does not broadcast"),
        ((q, k, v, jnp.zeros((1, 1, 1, 1, 7))), {}, ValueError, "bias must have rank <= 4"),
        ((q, k, v, jnp.zeros((4, 5, 7), jnp.int32)), {}, TypeError, "bias must be"),
        ((q, k, v, None, jnp.ones((2, 4, 5, 7))), {}, TypeError, "mask must be a boolean array"),
        ((q, k, v, None, jnp.ones((3, 4, 5, 7), bool)), {}, ValueError, "mask (3, 4, 5, 7) does not broadcast"),
    ]
    for args, kw, exc, msg in cases:
        with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)")) as info:
            jb.dot_product_attention(*args, **kw)
        assert op in str(info.value)
    with pytest.raises(TypeError, match="scale must be a Python number"):
        jax.jit(lambda s: jb.dot_product_attention(q, k, v, scale=s))(0.5)
