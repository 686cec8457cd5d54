"""models.MLP impl="brgemm" vs impl="xla" with the same parameters, beyond the fp32 forward
(tests/test_models_mlp.py): bf16 compute, widths that are no multiple of the kernel
blocks, input gradients, and a whole jitted optax training step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

models = pytest.importorskip("jax_brgemm.models")


def pair(activation, dtype=None, features=(300, 130)):
    kw = dict(features=features, num_classes=10, activation=activation, dtype=dtype)
    return models.MLP(impl="brgemm", **kw), models.MLP(impl="xla", **kw)


def close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.max(np.abs(b)))))


def batch(n=24, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.uniform(0, 1, (n, 28, 28)), jnp.float32), jnp.asarray(rng.integers(0, 10, n))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_bf16_outputs_and_grads(activation):
    ours, ref = pair(activation, jnp.bfloat16)
    x, _ = batch()
    params = ref.init(jax.random.key(0), x)
    y = jax.jit(ours.apply)(params, x)
    assert y.dtype == jnp.bfloat16
    close(y, jax.jit(ref.apply)(params, x), 5e-2)

    def loss(model):
        return lambda p, x: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss(ours), (0, 1)))(params, x)
    r = jax.jit(jax.grad(loss(ref), (0, 1)))(params, x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        close(a, b, 8e-2)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_sgd_training_steps_track_xla(dtype):
    """Three jitted optax SGD steps from the same start: the same parameters after each."""
    ours, ref = pair("relu", dtype, features=(96, 64))
    x, labels = batch(32, seed=1)
    params = ref.init(jax.random.key(1), x)
    opt = optax.sgd(0.1, momentum=0.9)

    def make_step(model):
        def loss(p):
            logits = model.apply(p, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        @jax.jit
        def step(p, s):
            value, g = jax.value_and_grad(loss)(p)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, value
        return step

    tol = 1e-4 if dtype is None else 5e-2
    p_ours, s_ours = params, opt.init(params)
    p_ref, s_ref = params, opt.init(params)
    step_ours, step_ref = make_step(ours), make_step(ref)
    for _ in range(3):
        p_ours, s_ours, l_ours = step_ours(p_ours, s_ours)
        p_ref, s_ref, l_ref = step_ref(p_ref, s_ref)
        close(l_ours, l_ref, tol)
        for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_ref), strict=True):
            assert a.dtype == b.dtype == jnp.float32
            close(a, b, tol)
