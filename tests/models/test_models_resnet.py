"""ResNet models: the ResNet-50 parameter count, identical variable trees for both impls,
and the same outputs, BatchNorm statistics and gradients in train and eval mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_brgemm import models


def count(tree):
    return sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("impl", ["brgemm", "xla"])
def test_resnet50_parameter_count(impl):
    shapes = jax.eval_shape(models.ResNet50(num_classes=1000, impl=impl).init, jax.random.key(0),
                            jnp.ones((1, 224, 224, 3)))
    assert count(shapes["params"]) == 25_557_032


def test_variable_trees_identical():
    x = jnp.ones((1, 64, 64, 3))
    for cls in (models.ResNet18, models.ResNet34, models.ResNet50):
        a = jax.eval_shape(cls(num_classes=10, impl="brgemm").init, jax.random.key(0), x)
        b = jax.eval_shape(cls(num_classes=10, impl="xla").init, jax.random.key(0), x)
        assert a == b
    with pytest.raises(ValueError, match="impl"):
        models.ResNet18(num_classes=10, impl="cuda").init(jax.random.key(0), x)


def test_small_image_parity_train_and_eval():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 28, 28, 1)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, 4))
    kw = dict(num_classes=10, num_filters=8, small_images=True)
    ours, stock = models.ResNet18(impl="brgemm", **kw), models.ResNet18(impl="xla", **kw)
    variables = stock.init(jax.random.key(1), x, train=False)
    assert jax.tree_util.tree_structure(ours.init(jax.random.key(1), x, train=False)) == \
        jax.tree_util.tree_structure(variables)

    def loss(model, params, x):
        logits, state = model.apply({**variables, "params": params}, x, train=True, mutable=["batch_stats"])
        one_hot = jax.nn.one_hot(labels, 10)
        return -jnp.mean(jnp.sum(one_hot * jax.nn.log_softmax(logits), -1)), (logits, state)

    results = {}
    for name, model in (("brgemm", ours), ("xla", stock)):
        (value, (logits, state)), grads = jax.jit(jax.value_and_grad(partial_loss(loss, model), has_aux=True))(
            variables["params"], x)
        eval_logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, x)
        results[name] = (value, logits, state, grads, eval_logits)
    leaves = {impl: jax.tree_util.tree_leaves(tree) for impl, tree in results.items()}
    for a, b in zip(leaves["brgemm"], leaves["xla"], strict=True):
        scale = 1 + float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-3 * scale, rtol=2e-3)


def partial_loss(loss, model):
    return lambda params, x: loss(model, params, x)
