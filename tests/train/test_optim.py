"""jax_brgemm.optim: a training step with the optimizer fused into the dense layers' weight
updates is optax's own step (value_and_grad + tx.update + apply_updates) over many steps,
with optax's state structure, for SGD with momentum (Nesterov, weight decay on every leaf
or masked), AdamW and Adam (with a schedule); for jb.nn.Dense models, stock flax models
under accelerate(), and models where only some layers qualify."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_brgemm as jb
import jax_brgemm.optim as jbo
from jax_brgemm.models import MLP
from jax_brgemm.train import optim as harness_optim


def _data(n=37, c=20, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(n, c)), jnp.float32), jnp.asarray(rng.integers(0, 10, n))


def _compare(model, tx, steps=25, n=37, rtol=2e-5, fused_calls=None, context=None):
    x, labels = _data(n)
    params = model.init(jax.random.key(1), x)["params"]

    def loss_fn(p, x, labels):
        logits = model.apply({"params": p}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @jax.jit
    def optax_step(p, s, x, labels):
        loss, g = jax.value_and_grad(loss_fn)(p, x, labels)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    ctx = context or (lambda: jax.named_scope("plain"))
    with ctx():
        fused = jax.jit(jbo.train_step(loss_fn, tx), donate_argnums=(0, 1))
        hlo = jax.jit(jbo.train_step(loss_fn, tx)).lower(params, tx.init(params), x, labels).as_text()
        if fused_calls is not None:
            assert hlo.count("jb_fc_upd_") == fused_calls
        a = (params, tx.init(params))
        b = jax.tree.map(jnp.copy, a)
        for _ in range(steps):
            *a, la = optax_step(*a, x, labels)
            *b, lb = fused(*b, x, labels)
    np.testing.assert_allclose(float(lb), float(la), rtol=1e-4)
    assert jax.tree.structure(a[1]) == jax.tree.structure(b[1])
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        np.testing.assert_allclose(v, u, rtol=rtol, atol=rtol * (np.abs(u).max() + 1e-12),
                                   err_msg=jax.tree_util.keystr(path))
    init = jax.tree.leaves(params)
    assert all(not np.array_equal(p, q) for p, q in zip(init, jax.tree.leaves(b[0])))


MLP_BRGEMM = MLP(features=(64, 48), num_classes=10, impl="brgemm")


@pytest.mark.parametrize("tx", [
    jbo.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),  # decay on every leaf
    jbo.sgd(0.05, momentum=0.9, weight_decay=1e-3, mask=harness_optim.kernel_mask),
    jbo.adamw(1e-2, weight_decay=1e-2),
    jbo.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=1e-2,
              mask=harness_optim.kernel_mask),
    jbo.adam(optax.cosine_decay_schedule(1e-2, 20), eps_root=1e-8),
], ids=["sgd-nesterov-decay", "sgd-masked", "adamw", "adamw-schedule-masked", "adam-schedule"])
def test_fused_step_is_optax_step(tx):
    _compare(MLP_BRGEMM, tx, fused_calls=3)


def test_stock_flax_model_under_accelerate():
    class Stock(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(10)(x)

    _compare(Stock(), jbo.adamw(1e-2), fused_calls=2,
             context=lambda: jb.accelerate(policy=False))


def test_only_the_layers_that_qualify_are_fused():
    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            shared = jb.nn.Dense(20, activation="relu")        # called twice: optax's step
            x = shared(shared(x))
            x = jb.nn.Dense(32, activation="gelu")(x)         # gelu: optax's step
            x = nn.LayerNorm()(x)                              # not a dense layer
            return jb.nn.Dense(10, activation="tanh")(x)       # fused

    _compare(Mixed(), jbo.sgd(0.05, momentum=0.9), fused_calls=1)
    _compare(Mixed(), jbo.adamw(1e-2), fused_calls=1)


def test_unmarked_optimizer_takes_the_generic_step():
    _compare(MLP_BRGEMM, optax.adamw(1e-2), steps=3, fused_calls=0)
    _compare(MLP_BRGEMM, jbo.sgd(0.05), steps=3, fused_calls=0)  # no momentum: nothing to fuse


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="loss_fn"):
        jbo.train_step(3, jbo.adamw(1e-3))
    with pytest.raises(TypeError, match="tx"):
        jbo.train_step(lambda p: 0.0, "adamw")
    with pytest.raises(ValueError, match="kind"):
        jbo.fusable(optax.sgd(0.1), jbo.Rule("lion", 0.1))
    x, dz, k = jnp.ones((4, 3)), jnp.ones((4, 5)), jnp.ones((3, 5))
    with pytest.raises(ValueError, match="together"):
        jb.ops.dense.adamw_update(x, dz, k, k, k, jnp.ones(5), None, jnp.ones(5), 0.1, 0,
                                  b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
