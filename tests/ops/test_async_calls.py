"""The FC handlers return before their work is done where it is large enough to split
(asynchronous FFI calls): the results are the synchronous path's, bit for bit, every time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb
from jax_brgemm import _jax_brgemm as native
from jax_brgemm.ops.dense import sgd_update


@pytest.fixture
def async_mode():
    was = native.async_enabled()
    yield native.set_async
    native.set_async(was)


def _mlp_loss(params, x):
    for i, (w, b) in enumerate(params):
        x = jb.dense(x, w, b, activation="relu" if i < len(params) - 1 else None)
    return jnp.sum(x.astype(jnp.float32) ** 2)


@pytest.mark.parametrize("n", [7, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mlp_gradients_bitwise_equal_sync_and_async(async_mode, n, dtype):
    rng = np.random.default_rng(n)
    widths = (300, 512, 256, 10)
    params = [(jnp.asarray(rng.standard_normal((c, k)) / 16, jnp.float32),
               jnp.asarray(rng.standard_normal(k), jnp.float32)) for c, k in zip(widths[:-1], widths[1:])]
    x = jnp.asarray(rng.standard_normal((n, widths[0])), dtype)
    f = jax.jit(jax.value_and_grad(_mlp_loss, argnums=(0, 1)))
    async_mode(False)
    want = jax.tree.leaves(jax.block_until_ready(f(params, x)))
    async_mode(True)
    for _ in range(5):  # several steps in flight one after another
        got = jax.tree.leaves(jax.block_until_ready(f(params, x)))
        for a, b in zip(want, got):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_fused_sgd_update_bitwise_equal_sync_and_async(async_mode):
    rng = np.random.default_rng(0)
    x, dz = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((256, 300), (256, 200)))
    w, b = jnp.asarray(rng.standard_normal((300, 200)), jnp.float32), jnp.asarray(rng.standard_normal(200), jnp.float32)
    f = jax.jit(lambda *s: sgd_update(x, dz, *s, 0.01, momentum=0.9, nesterov=True, weight_decay=1e-4))
    results = []
    for mode in (False, True):
        async_mode(mode)
        state = (w, jnp.zeros_like(w), b, jnp.zeros_like(b))
        for _ in range(4):
            state = f(*state)
        results.append([np.asarray(a) for a in state])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
