"""jb.nn.Dense against flax.linen.Dense: identical parameters, stock checkpoints load,
same outputs and gradients, dtype / param_dtype semantics."""

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import jax_brgemm as jb

FLAX_ACT = {None: lambda v: v, "relu": fnn.relu, "gelu": fnn.gelu, "sigmoid": fnn.sigmoid,
            "tanh": jnp.tanh}


def inputs(shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def stock(features, activation=None, **kw):
    """flax.linen.Dense followed by the activation: what jb.nn.Dense replaces."""
    class Stock(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return FLAX_ACT[activation](fnn.Dense(features, name="inner", **kw)(x))
    return Stock()


def apply_stock(features, activation, params, x, **kw):
    return stock(features, activation, **kw).apply({"params": {"inner": params["params"]}}, x)


def assert_close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("kw", [{}, {"use_bias": False}, {"param_dtype": jnp.bfloat16},
                                {"dtype": jnp.bfloat16},
                                {"kernel_init": fnn.initializers.normal(0.3),
                                 "bias_init": fnn.initializers.constant(0.1)}])
def test_parameters_equal_flax(kw):
    x = inputs((4, 7))
    key = jax.random.key(42)
    ours = jb.nn.Dense(5, activation="relu", **kw).init(key, x)
    theirs = fnn.Dense(5, **kw).init(key, x)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "sigmoid", "tanh"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_outputs_and_grads_match_flax(activation, use_bias):
    x = inputs((3, 11, 40))
    params = fnn.Dense(70, use_bias=use_bias).init(jax.random.key(1), x)  # a stock checkpoint
    ours = jb.nn.Dense(70, use_bias=use_bias, activation=activation)

    def loss(apply):
        return lambda p, x: jnp.sum(jnp.cos(apply(p, x)) * jnp.arange(70.0) / 70)

    f_ours = lambda p, x: ours.apply(p, x)
    f_theirs = lambda p, x: apply_stock(70, activation, p, x, use_bias=use_bias)
    assert_close(jax.jit(f_ours)(params, x), f_theirs(params, x), 1e-5)
    g = jax.jit(jax.grad(loss(f_ours), (0, 1)))(params, x)
    r = jax.grad(loss(f_theirs), (0, 1))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(r)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, 1e-5)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_bf16_compute_fp32_params(activation):
    """dtype=bf16, param_dtype=f32 (Flax's mixed precision): bf16 activations, fp32 params
    and fp32 parameter gradients, values within bf16 rounding of Flax's."""
    x = inputs((64, 96))
    layer = jb.nn.Dense(48, activation=activation, dtype=jnp.bfloat16)
    params = layer.init(jax.random.key(0), x)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
    y = jax.jit(layer.apply)(params, x)
    want = apply_stock(48, activation, params, x, dtype=jnp.bfloat16)
    assert y.dtype == want.dtype == jnp.bfloat16
    assert_close(y, want, 2e-2)
    loss = lambda apply: (lambda p, x: jnp.sum(apply(p, x).astype(jnp.float32) ** 2))
    g = jax.jit(jax.grad(loss(layer.apply), (0, 1)))(params, x)
    r = jax.grad(loss(lambda p, x: apply_stock(48, activation, p, x, dtype=jnp.bfloat16)), (0, 1))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(r)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, 5e-2)


def test_dtype_promotion_like_flax():
    x = inputs((2, 6))
    for kw in [{}, {"param_dtype": jnp.bfloat16}, {"dtype": jnp.bfloat16},
               {"param_dtype": jnp.bfloat16, "dtype": jnp.float32}]:
        for xin in (x, x.astype(jnp.bfloat16)):
            ours = jb.nn.Dense(3, **kw)
            params = ours.init(jax.random.key(0), xin)
            assert ours.apply(params, xin).dtype == fnn.Dense(3, **kw).apply(params, xin).dtype, kw
    # integer inputs are promoted to float, as in flax
    ints = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    params = jb.nn.Dense(3).init(jax.random.key(0), ints)
    assert_close(jb.nn.Dense(3).apply(params, ints), fnn.Dense(3).apply(params, ints), 1e-5)


def test_stock_checkpoint_loads_unchanged():
    """A serialized flax.linen model restores into the jb twin and computes the same."""
    class Net(fnn.Module):
        dense: type = fnn.Dense

        @fnn.compact
        def __call__(self, x):
            x = fnn.relu(self.dense(32)(x)) if self.dense is fnn.Dense else self.dense(32, activation="relu")(x)
            return self.dense(4)(x)

    x = inputs((5, 12))
    stock_params = Net().init(jax.random.key(3), x)
    blob = serialization.to_bytes(stock_params)
    template = Net(dense=jb.nn.Dense).init(jax.random.key(9), x)
    restored = serialization.from_bytes(template, blob)
    assert_close(Net(dense=jb.nn.Dense).apply(restored, x), Net().apply(stock_params, x), 1e-5)


def test_unknown_activation():
    with pytest.raises(ValueError, match="unknown activation"):
        jb.nn.Dense(3, activation="swish").init(jax.random.key(0), jnp.ones((1, 2)))


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        jb.nn.Dense(3, dtype=jnp.float16).init(jax.random.key(0), jnp.ones((1, 2)))
