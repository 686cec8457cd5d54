"""models.MLP: one parameter tree for both impls; brgemm computes what xla computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_brgemm.models import MLP


def _init(model, shape=(4, 28, 28)):
    return model.init(jax.random.key(0), jnp.zeros(shape))


def test_xla_mlp_shapes_and_flattening():
    model = MLP(features=(16, 8), num_classes=10, impl="xla")
    params = _init(model)
    shapes = jax.tree.map(jnp.shape, params["params"])
    assert shapes == {"Dense_0": {"kernel": (784, 16), "bias": (16,)},
                      "Dense_1": {"kernel": (16, 8), "bias": (8,)},
                      "Dense_2": {"kernel": (8, 10), "bias": (10,)}}
    x = jax.random.uniform(jax.random.key(1), (4, 28, 28))
    np.testing.assert_allclose(model.apply(params, x), model.apply(params, x.reshape(4, 784)),
                               rtol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"impl": "cuda"}, "impl"),
    ({"activation": "swish"}, "activation"),
    ({"features": (0,)}, "positive"),
])
def test_bad_arguments_raise(kwargs, message):
    model = MLP(**{"features": (8,), "num_classes": 10, "impl": "xla", **kwargs})
    with pytest.raises(ValueError, match=message):
        _init(model)


def test_bfloat16_compute_keeps_float32_params():
    model = MLP(features=(8,), num_classes=10, impl="xla", dtype=jnp.bfloat16)
    params = _init(model)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    assert model.apply(params, jnp.ones((2, 28, 28))).dtype == jnp.bfloat16


@pytest.mark.parametrize("activation", ["relu", "gelu", "sigmoid", "tanh"])
def test_brgemm_matches_xla_with_the_same_params(activation):
    pytest.importorskip("jax_brgemm.nn")
    xla = MLP(features=(64, 32), num_classes=10, activation=activation, impl="xla")
    brgemm = MLP(features=(64, 32), num_classes=10, activation=activation, impl="brgemm")
    params = _init(xla)
    assert jax.tree.structure(_init(brgemm)) == jax.tree.structure(params)
    x = jax.random.normal(jax.random.key(2), (8, 28, 28))
    np.testing.assert_allclose(brgemm.apply(params, x), xla.apply(params, x),
                               rtol=1e-4, atol=1e-4)

    def loss(model):
        return lambda p: jnp.sum(model.apply(p, x) ** 2)

    grads = [jax.grad(loss(m))(params) for m in (brgemm, xla)]
    for g_brgemm, g_xla in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_allclose(g_brgemm, g_xla, rtol=1e-3, atol=1e-3)
