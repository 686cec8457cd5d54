"""models.LSTMClassifier and models.GNMTEncoder: one parameter tree for both impls; brgemm
computes what xla (stock Flax nn.RNN(OptimizedLSTMCell)) computes, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_brgemm.models import LAYERS, GNMTEncoder, LSTMClassifier


def _close(a, b, tol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol)


def _shapes(tree):
    return jax.tree_util.tree_map(jnp.shape, tree)


@pytest.mark.parametrize("make, shape", [
    (lambda impl: LSTMClassifier(features=(12, 8), num_classes=10, impl=impl), (3, 6, 5)),
    pytest.param(lambda impl: GNMTEncoder(features=8, impl=impl), (2, 5, 8), marks=pytest.mark.slow),
])
def test_same_tree_and_results(make, shape):
    x = jax.random.normal(jax.random.key(0), shape)
    xla, brgemm = make("xla"), make("brgemm")
    params = xla.init(jax.random.key(1), x)
    mine = brgemm.init(jax.random.key(1), x)
    assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(params)
    assert _shapes(mine) == _shapes(params)
    _close(mine, params, 0)  # same initializers, same names: the same values

    def loss(model):
        return lambda p, x: jnp.sum(jnp.sin(model.apply(p, x)))

    y = jax.jit(brgemm.apply)(params, x)
    _close(y, xla.apply(params, x), 2e-5)
    _close(jax.jit(jax.grad(loss(brgemm), argnums=(0, 1)))(params, x),
           jax.grad(loss(xla), argnums=(0, 1))(params, x), 1e-4)


def test_classifier_tree_names_and_bf16():
    model = LSTMClassifier(features=(6,), num_classes=3, impl="brgemm", dtype=jnp.bfloat16)
    x = jnp.ones((2, 4, 5))
    params = model.init(jax.random.key(0), x)["params"]
    assert sorted(params) == ["Dense_0", "LSTM_0"]
    assert sorted(params["LSTM_0"]["cell"]) == ["hf", "hg", "hi", "ho", "if", "ig", "ii", "io"]
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    y = model.apply({"params": params}, x)
    assert y.shape == (2, 3) and y.dtype == jnp.bfloat16
    stock = LSTMClassifier(features=(6,), num_classes=3, impl="xla", dtype=jnp.bfloat16)
    _close(y, stock.apply({"params": params}, x), 3e-2)


def test_gnmt_residuals_and_bidirectional_first_layer():
    params = GNMTEncoder(features=4, impl="xla").init(jax.random.key(0), jnp.ones((1, 3, 4)))["params"]
    assert sorted(params) == ["LSTM_0_bw", "LSTM_0_fw", "LSTM_1", "LSTM_2", "LSTM_3"]
    assert params["LSTM_1"]["cell"]["ii"]["kernel"].shape == (8, 4)  # fw | bw concatenated


def test_layers_registry_and_bad_arguments():
    assert set(LAYERS) == {"brgemm", "xla"} and all(hasattr(v, "lstm") for v in LAYERS.values())
    with pytest.raises(ValueError, match="impl"):
        LSTMClassifier(features=(4,), num_classes=2, impl="cuda").init(jax.random.key(0), jnp.ones((1, 2, 3)))
    with pytest.raises(ValueError, match="positive"):
        LSTMClassifier(features=(0,), num_classes=2, impl="xla").init(jax.random.key(0), jnp.ones((1, 2, 3)))
