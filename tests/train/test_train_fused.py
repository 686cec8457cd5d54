"""The train step with the optimizer fused into the dense layers' weight updates
(src/jax_brgemm/train/fused.py) is optax's step: the same parameters, optimizer state and
step count after several steps, on the ``mlp`` benchmark's model and on a small one with
odd sizes, fp32 and bf16, SGD (Nesterov or not, with weight decay), Adam and AdamW; where
it does not apply, ``plan`` says so and the harness takes the generic step."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb
from jax_brgemm.models import MLP
from jax_brgemm.ops import dense as dense_ops
from jax_brgemm.train import data, fused, hparams, optim, step, suite

STEPS_PER_EPOCH = 4


def _bench(model_fn, features):
    mlp = suite.SUITE["mlp"]
    return dataclasses.replace(mlp, model=model_fn, name=f"mlp_{features}")


def _batches(bench, n, count, seed=0):
    rng = np.random.default_rng(seed)
    spec = bench.dataset.files["train_images"]
    out = []
    for _ in range(count):
        weight = np.ones(n, np.float32)
        weight[-1] = 0.0  # a padding row, as the harness's last batch has
        out.append(data.Batch(rng.integers(0, 256, (n, *spec.shape[1:]), np.uint8),
                              rng.integers(0, 10, n).astype(np.int32), weight))
    return out


def _states(bench, model, hp, batches, fused_steps):
    """(optax's state, the fused step's state) after the batches, from the same init."""
    tx = optim.make(hp, STEPS_PER_EPOCH)
    example = bench.pipeline.preprocess(jnp.asarray(batches[0].inputs[:1]))
    state = step.create_state(bench, model, tx, jax.random.key(1), example)
    p = fused.plan(bench, state, example, hp, STEPS_PER_EPOCH)
    assert p is not None and p.sites == len(state.params)
    generic = jax.jit(functools.partial(step.train_step, bench=bench))
    fast = jax.jit(functools.partial(fused.train_step, bench=bench, plan=p), donate_argnums=0)
    a, b = state, jax.tree.map(jnp.copy, state)
    for batch in batches[:fused_steps]:
        a, loss_a = generic(a, batch)
        b, loss_b = fast(b, batch)
        np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5)
    return a, b


@pytest.mark.parametrize("opt,dtype,nesterov,weight_decay,features", [
    ("sgd", "float32", True, 0.0, (1024, 1024, 1024)),   # the main job's model and optimizer
    ("sgd", "float32", False, 1e-3, (33, 1)),
    ("sgd", "bfloat16", True, 5e-4, (130, 47)),
    ("adamw", "float32", False, 1e-2, (1024, 1024, 1024)),
    ("adamw", "bfloat16", False, 1e-2, (130, 47)),
    ("adam", "float32", False, 0.0, (33, 1)),
])
def test_fused_step_is_optax_step(opt, dtype, nesterov, weight_decay, features):
    dt = jnp.bfloat16 if dtype == "bfloat16" else None
    model = MLP(features=features, num_classes=10, impl="brgemm", dtype=dt)
    bench = _bench(lambda impl, dtype: model, features)
    hp = {**hparams.defaults(bench, opt), "opt_learning_rate_warmup_epochs": 0.0}
    if opt == "sgd":
        hp.update(sgd_opt_nesterov=nesterov, opt_weight_decay=weight_decay)
    elif opt == "adamw":
        hp.update(opt_adamw_weight_decay=weight_decay)
    steps = 3 if opt == "sgd" else 6
    a, b = _states(bench, model, hp, _batches(bench, 37, steps), steps)
    assert int(b.step) == int(a.step) == steps
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    # Adam's m / sqrt(v) turns a last-bit difference (XLA's fusion against the C++ loop)
    # into a larger one where v is tiny: bound those by 1e-4 of the leaf's scale
    atol = 1e-4 if opt != "sgd" and dtype == "float32" else tol
    moved = 0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                            strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape and x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_allclose(y, x, rtol=tol, atol=atol * (np.abs(x).max() + 1e-12),
                                   err_msg=jax.tree_util.keystr(path))
    # the parameters did move (lr > 0 from the first step): the comparison is not vacuous
    init = step.create_state(bench, model, optim.make(hp, STEPS_PER_EPOCH), jax.random.key(1),
                             bench.pipeline.preprocess(jnp.zeros((1, 28, 28), jnp.uint8)))
    for x, y in zip(jax.tree.leaves(init.params), jax.tree.leaves(b.params), strict=True):
        moved += int(not np.array_equal(np.asarray(x), np.asarray(y)))
    assert moved == len(jax.tree.leaves(b.params))
    assert jax.tree.structure(a.opt_state) == jax.tree.structure(b.opt_state)


def test_plan_only_where_it_applies():
    bench = suite.SUITE["mlp"]
    hp = hparams.defaults(bench, "sgd")
    example = jnp.zeros((1, 784))
    tx = optim.make(hp, STEPS_PER_EPOCH)

    def state_of(model):
        return step.create_state(bench, model, tx, jax.random.key(0), example)

    mlp = MLP(features=(16,), num_classes=10, impl="brgemm")
    assert fused.plan(bench, state_of(mlp), example, hp, STEPS_PER_EPOCH) is not None
    # stock flax layers, an optimizer without a fused rule, several processes: no plan; an
    # activation whose derivative needs the pre-activation: that layer takes optax's step
    assert fused.plan(bench, state_of(MLP(features=(16,), num_classes=10, impl="xla")), example, hp,
                      STEPS_PER_EPOCH) is None
    gelu = MLP(features=(16,), num_classes=10, impl="brgemm", activation="gelu")
    assert fused.plan(bench, state_of(gelu), example, hp, STEPS_PER_EPOCH).sites == 1  # the logits
    lamb = hparams.defaults(bench, "lamb")
    assert fused.plan(bench, state_of(mlp), example, lamb, STEPS_PER_EPOCH) is None
    assert fused.plan(bench, state_of(mlp), example, hp, STEPS_PER_EPOCH, processes=2) is None

    class Shared(nn.Module):  # one layer called twice: its gradient is a sum of two
        @nn.compact
        def __call__(self, x):
            d = jb.nn.Dense(784)
            return jb.nn.Dense(10)(d(d(x)))

    # only the last layer is fused; the shared one takes optax's own step
    assert fused.plan(bench, state_of(Shared()), example, hp, STEPS_PER_EPOCH).sites == 1

    class CustomDot(nn.Module):  # a layer whose product is not x @ kernel
        @nn.compact
        def __call__(self, x):
            return jb.nn.Dense(10, dot_general=lambda a, b, *args, **kw: jax.lax.dot_general(
                a, 2 * b, *args, **kw))(x)

    assert fused.plan(bench, state_of(CustomDot()), example, hp, STEPS_PER_EPOCH) is None


def test_sgd_update_rejects_bad_operands():
    x, dz = jnp.ones((4, 3)), jnp.ones((4, 5))
    k, b = jnp.ones((3, 5)), jnp.ones((5,))
    kw = dict(momentum=0.9, nesterov=True, weight_decay=0.0)
    with pytest.raises(ValueError, match="must be"):
        dense_ops.sgd_update(x, dz, jnp.ones((5, 3)), jnp.ones((5, 3)), b, b, 0.1, **kw)
    with pytest.raises(ValueError, match="float32"):
        dense_ops.sgd_update(x, dz, k.astype(jnp.bfloat16), k, b, b, 0.1, **kw)
    with pytest.raises(ValueError, match="together"):
        dense_ops.sgd_update(x, dz, k, k, b, None, 0.1, **kw)
    with pytest.raises(ValueError, match="share"):
        dense_ops.sgd_update(x, dz.astype(jnp.bfloat16), k, k, b, b, 0.1, **kw)
    # and a correct call updates as optax's rule: w -= lr * (g' + mu * m'), m' = g' + mu * m
    k2, m2, b2, mb2 = jax.jit(functools.partial(dense_ops.sgd_update, **kw))(
        x, dz, k, jnp.zeros_like(k), b, jnp.zeros_like(b), 0.1)
    g = np.asarray(x).T @ np.asarray(dz)
    np.testing.assert_allclose(m2, g, rtol=1e-6)
    np.testing.assert_allclose(k2, 1 - 0.1 * (g + 0.9 * g), rtol=1e-6)
    np.testing.assert_allclose(b2, 1 - 0.1 * (4 + 0.9 * 4) * np.ones(5), rtol=1e-6)
    np.testing.assert_allclose(mb2, 4 * np.ones(5), rtol=1e-6)


def test_the_harness_takes_the_fused_step_for_brgemm_sgd():
    from jax_brgemm.train import loop

    bench = suite.SUITE["mlp"]
    example = jnp.zeros((1, 784))

    def step_for(impl, opt_name, processes=1):
        hp = hparams.defaults(bench, opt_name)
        cfg = loop.RunConfig(bench=bench, impl=impl, division="closed", dtype="float32", hparams=hp,
                             max_epochs=1, config_filename="config.json")
        model = MLP(features=(16,), num_classes=10, impl=impl)
        state = step.create_state(bench, model, optim.make(hp, 4), jax.random.key(0), example)
        return loop.train_step_for(cfg, state, example, 4, processes=processes).func

    assert step_for("brgemm", "sgd") is fused.train_step
    assert step_for("xla", "sgd") is step.train_step
    assert step_for("brgemm", "adamw") is fused.train_step
    assert step_for("brgemm", "lars") is step.train_step
    assert step_for("brgemm", "sgd", processes=2) is step.train_step


class _Rows(nn.Module):
    """A dense layer over every row of a (N, 4, 196) input, then logits: x and dz of the
    first layer are (N, 4, C) and fold into (4N, C) rows."""

    @nn.compact
    def __call__(self, x):
        x = jb.nn.Dense(24, activation="tanh")(x.reshape(x.shape[0], 4, 196))
        return jb.nn.Dense(10, use_bias=False)(x.reshape(x.shape[0], -1))


def test_fused_step_with_batched_rows_and_no_bias():
    model = _Rows()
    bench = _bench(lambda impl, dtype: model, "rows")
    hp = {**hparams.defaults(bench, "sgd"), "opt_learning_rate_warmup_epochs": 0.0,
          "opt_weight_decay": 1e-3}
    a, b = _states(bench, model, hp, _batches(bench, 9, 3, seed=2), 3)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)
