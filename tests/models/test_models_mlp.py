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
    for g_brgemm, g_xla in zip(*map(jax.tree.leaves, grads), strict=True):
        np.testing.assert_allclose(g_brgemm, g_xla, rtol=1e-3, atol=1e-3)


def test_impls_name_the_layer_classes():
    import flax.linen as fnn

    import jax_brgemm as jb
    from jax_brgemm import models

    assert models.IMPLS == ("brgemm", "xla") and set(models.LAYERS) == set(models.IMPLS)
    assert models.layers("brgemm").dense is jb.nn.Dense
    assert models.layers("xla").dense is fnn.Dense
    with pytest.raises(ValueError, match="impl must be one of"):
        models.layers("cuda")


@pytest.mark.parametrize("impl", ["brgemm", "xla"])
def test_injected_dense_class_is_the_impl(impl):
    """MLP(dense=cls) builds the same model as the impl that names cls, and only impl="brgemm"
    calls the kernels."""
    from jax_brgemm import models

    x = jax.random.normal(jax.random.key(2), (3, 20))
    by_impl = MLP(features=(9,), num_classes=4, activation="gelu", impl=impl)
    injected = MLP(features=(9,), num_classes=4, activation="gelu",
                   dense=models.layers(impl).dense)
    params = _init(by_impl, (3, 20))
    np.testing.assert_array_equal(by_impl.apply(params, x), injected.apply(params, x))
    hlo = jax.jit(by_impl.apply).lower(params, x).as_text()
    assert ("jb_fc_fwd" in hlo) == (impl == "brgemm")


def test_activated_fuses_or_applies_after():
    import flax.linen as fnn

    import jax_brgemm as jb
    from jax_brgemm.models import activated
    from jax_brgemm.models.layers import fuses_activation

    assert fuses_activation(jb.nn.Dense) and not fuses_activation(fnn.Dense)

    class One(fnn.Module):
        cls: type

        @fnn.compact
        def __call__(self, x):
            return activated(self.cls, "tanh", features=3, name="Dense_0")(x)

    x = jax.random.normal(jax.random.key(0), (2, 5))
    params = One(fnn.Dense).init(jax.random.key(1), x)
    want = jnp.tanh(fnn.Dense(3).apply({"params": params["params"]["Dense_0"]}, x))
    for cls in (fnn.Dense, jb.nn.Dense):
        np.testing.assert_allclose(One(cls).apply(params, x), want, rtol=1e-5, atol=1e-6)
    # fused: one kernel call and no separate tanh in the jitted program
    hlo = jax.jit(One(jb.nn.Dense).apply).lower(params, x).as_text()
    assert "jb_fc_fwd" in hlo and "tanh" not in hlo
