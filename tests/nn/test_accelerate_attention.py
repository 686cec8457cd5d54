"""jax_brgemm.accelerate() on Transformer layers: stock flax.linen MultiHeadDotProductAttention
and DenseGeneral give the stock outputs and gradients with their attention and projections on
the kernels; configurations the kernels do not take run stock and say why. And
jb.nn.dot_product_attention as a stock module's attention_fn."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb

RNG = np.random.default_rng(0)


def normal(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def assert_close(got, want, tol):
    for a, b in zip(leaves(got), leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.max(np.abs(b)))))


def value_and_grad(f):
    return jax.jit(jax.value_and_grad(lambda p, *a: jnp.sum(jnp.sin(f(p, *a).astype(jnp.float32))), argnums=(0, 1)))


def check(module, args, tol=2e-5, calls=None, **kw):
    """accelerate()'s value and gradients (parameters and first input) against stock's."""
    params = module.init(jax.random.key(0), *args, **kw)
    f = lambda p, *a: module.apply(p, *a, **kw)
    want = value_and_grad(f)(params, *args)
    with jb.accelerate() as acc:
        got = value_and_grad(f)(params, *args)
    assert_close(got, want, tol)
    if calls is not None:
        assert [(c.layer, c.accelerated) for c in acc.calls] == calls, acc.calls
    return acc


ON_KERNELS = [("DenseGeneral", True)] * 3 + [("MultiHeadDotProductAttention", True), ("DenseGeneral", True)]


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention(causal):
    x = normal(2, 13, 32)
    mask = nn.make_causal_mask(jnp.ones((2, 13))) if causal else None
    check(nn.MultiHeadDotProductAttention(num_heads=4), (x,), calls=ON_KERNELS, mask=mask)


def test_cross_attention_with_padding_and_batch_dims():
    """Queries and keys of different lengths, a float padding mask (make_attention_mask), two
    batch dims, qkv_features and out_features of their own, normalize_qk."""
    q, kv = normal(2, 3, 7, 24), normal(2, 3, 11, 16)
    valid = jnp.asarray(RNG.random((2, 3, 11)) > 0.3)
    mask = nn.make_attention_mask(jnp.ones((2, 3, 7)), valid)
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32, out_features=20, normalize_qk=True)
    check(mha, (q, kv), calls=ON_KERNELS, mask=mask)


def test_bfloat16_computation():
    """dtype=bfloat16: the kernels' softmax is float32 where Flax's is bfloat16; both against
    the float32 computation on the same parameters."""
    x = normal(2, 16, 32)
    mha16, mha32 = (nn.MultiHeadDotProductAttention(num_heads=4, dtype=d) for d in (jnp.bfloat16, jnp.float32))
    params = mha32.init(jax.random.key(0), x)
    want = mha32.apply(params, x)
    with jb.accelerate() as acc:
        got = jax.jit(mha16.apply)(params, x)
    assert got.dtype == jnp.bfloat16 and all(c.accelerated for c in acc.calls)
    assert_close(got, want, 3e-2)


def test_fallbacks_say_why():
    x = normal(2, 5, 16)
    cases = [
        (nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=lambda q, k, v: nn.dot_product_attention(q, k, v)),
         "custom attention_fn", {}),
        (nn.MultiHeadDotProductAttention(num_heads=2), "attention weights sown", {"sow_weights": True}),
    ]
    for mha, reason, kw in cases:
        rngs = kw.pop("rngs", None)
        params = mha.init(jax.random.key(0), x)
        want = mha.apply(params, x, rngs=rngs, **kw)
        with jb.accelerate() as acc:
            got = mha.apply(params, x, rngs=rngs, **kw)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        attention = [c for c in acc.calls if c.layer == "MultiHeadDotProductAttention"]
        assert attention and not attention[0].accelerated and attention[0].reason == reason, acc.calls


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dropout_on_the_kernels(broadcast, dtype):
    """A stock module with attention dropout: on the kernels, the same weights dropped as
    stock (the same rng), the loss and its gradients equal under jit."""
    x = normal(2, 37, 32)
    mha = nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.2, broadcast_dropout=broadcast,
                                          deterministic=False, dtype=dtype)
    params = mha.init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(1)}

    def loss(p):
        return jnp.sum(jnp.sin(mha.apply(p, x, rngs=rngs).astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss))
    want = step(params)
    with jb.accelerate() as acc:
        got = step(params)
    assert all(c.accelerated for c in acc.calls), acc.calls
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(got[0], want[0], rtol=tol)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert_close(g, w, tol * 10 if dtype == jnp.bfloat16 else tol)
    ours = jb.nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.2, broadcast_dropout=broadcast,
                                              deterministic=False, dtype=dtype)
    assert_close(ours.apply(params, x, rngs=rngs), mha.apply(params, x, rngs=rngs), tol)


def test_decode_runs_stock():
    mha = nn.MultiHeadDotProductAttention(num_heads=2, decode=True)
    x = normal(2, 1, 16)
    variables = mha.init(jax.random.key(0), jnp.zeros((2, 4, 16)))
    with jb.accelerate() as acc:
        y, _ = mha.apply(variables, x, mutable=["cache"])
    want, _ = mha.apply(variables, x, mutable=["cache"])
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    reasons = [c.reason for c in acc.calls if c.layer == "MultiHeadDotProductAttention"]
    assert reasons == ["decode (the key / value cache)"]


@pytest.mark.parametrize("axis,features,shape", [(-1, (4, 8), (3, 5, 12)), ((-2, -1), 7, (3, 5, 4, 8)),
                                                 ((1, 2), (2, 3), (4, 5, 6))])
def test_dense_general(axis, features, shape):
    check(nn.DenseGeneral(features, axis=axis), (normal(*shape),), calls=[("DenseGeneral", True)])


@pytest.mark.parametrize("layer,reason", [
    (nn.DenseGeneral(4, axis=1), "contracting axes other than the input's last ones"),
    (nn.DenseGeneral(4, axis=-1, batch_dims=(0,)), "batch_dims")])
def test_dense_general_fallbacks(layer, reason):
    acc = check(layer, (normal(3, 5, 6),))
    assert [(c.accelerated, c.reason) for c in acc.calls] == [(False, reason)]


def test_attention_fn_drop_in():
    """jb.nn.dot_product_attention as a stock module's attention_fn, outside accelerate()."""
    x = normal(2, 9, 16)
    mask = nn.make_causal_mask(jnp.ones((2, 9)))
    stock = nn.MultiHeadDotProductAttention(num_heads=2)
    ours = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=jb.nn.dot_product_attention)
    params = stock.init(jax.random.key(0), x)
    f = lambda m: value_and_grad(lambda p, x: m.apply(p, x, mask=mask))(params, x)
    assert_close(f(ours), f(stock), 2e-5)
    assert "jb_attention_fwd" in jax.jit(lambda p, x: ours.apply(p, x, mask=mask)).lower(params, x).as_text()


@pytest.mark.parametrize("shape,spec,x_shape", [
    ((12, 3, 5), "btd,dnh->btnh", (2, 7, 12)),
    ((3, 5, 9), "...nh,nhd->...d", (2, 7, 3, 5)),
    ((6, 12), "btd,hd->bth", (2, 7, 12)),  # the kernel transposed to (contracted, features)
])
def test_einsum(shape, spec, x_shape):
    check(nn.Einsum(shape, spec), (normal(*x_shape),), calls=[("Einsum", True)])


def test_einsum_given_at_the_call_and_in_bfloat16():
    x = normal(3, 12)
    check(nn.Einsum((12, 5), use_bias=False), (x,), calls=[("Einsum", True)], einsum_str="bd,dk->bk")
    check(nn.Einsum((12, 5), "bd,dk->bk", dtype=jnp.bfloat16), (x,), tol=3e-2, calls=[("Einsum", True)])


@pytest.mark.parametrize("shape,spec,reason", [
    ((6, 3, 4), "btd,dnh->bnth", "output axes other than the input's others, then the features"),
    ((5, 4), "bdt,dk->btk", "contracting axes other than the input's last ones"),
    ((3, 6, 4), "btd,bdk->btk", "axes of the input, kernel and output (a batched product)"),
])
def test_einsum_fallbacks(shape, spec, reason):
    acc = check(nn.Einsum(shape, spec), (normal(3, 5, 6),))
    assert [(c.accelerated, c.reason) for c in acc.calls] == [(False, reason)]
