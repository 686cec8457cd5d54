"""The handlers (FC passes, the fused optimizer updates, jb.brgemm, attention, convolution) return before
their work is done where it is large enough to split (asynchronous FFI calls): the results
are the synchronous path's, bit for bit, every time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb
from jax_brgemm import _jax_brgemm as native
from jax_brgemm.ops.dense import adamw_update, sgd_update


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


def test_fused_adamw_update_bitwise_equal_sync_and_async(async_mode):
    rng = np.random.default_rng(1)
    x, dz = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((256, 300), (256, 200)))
    w, b = jnp.asarray(rng.standard_normal((300, 200)), jnp.float32), jnp.asarray(rng.standard_normal(200), jnp.float32)
    f = jax.jit(lambda count, *s: adamw_update(x, dz, *s, 1e-3, count, b1=0.9, b2=0.999, eps=1e-8,
                                               weight_decay=1e-4, bias_weight_decay=1e-4))
    results = []
    for mode in (False, True):
        async_mode(mode)
        state = (w, jnp.zeros_like(w), jnp.zeros_like(w), b, jnp.zeros_like(b), jnp.zeros_like(b))
        for count in range(4):
            state = f(jnp.int32(count), *state)
        results.append([np.asarray(a) for a in state])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def _twice(f, *args):
    """f's results with synchronous calls, then asynchronous ones several times over."""
    native.set_async(False)
    want = [np.asarray(a, np.float32) for a in jax.tree.leaves(jax.block_until_ready(f(*args)))]
    native.set_async(True)
    for _ in range(3):
        got = [np.asarray(a, np.float32) for a in jax.tree.leaves(jax.block_until_ready(f(*args)))]
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_brgemm_bitwise_equal_sync_and_async(async_mode, dtype):
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((4, 16, 96, 64)), dtype)
    b = jnp.asarray(rng.standard_normal((4, 16, 64, 80)), dtype)
    c = jnp.asarray(rng.standard_normal((4, 96, 80)), jnp.float32)

    def loss(a, b, c):  # the op, its accumulating form, and both gradients (more brgemm calls)
        return jnp.sum(jb.brgemm(a, b) ** 2) + jnp.sum(jb.brgemm(a, b, c) * 0.5)

    _twice(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), a, b, c)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_bitwise_equal_sync_and_async(async_mode, dtype, causal):
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 128, 4, 64)), dtype)
    k = jnp.asarray(rng.standard_normal((2, 160, 2, 64)), dtype)
    v = jnp.asarray(rng.standard_normal((2, 160, 2, 64)), dtype)
    bias = jnp.asarray(rng.standard_normal((1, 4, 128, 160)), jnp.float32) if not causal else None

    def loss(q, k, v):
        o = jb.dot_product_attention(q, k, v, bias=bias, is_causal=causal)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    _twice(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), q, k, v)


# (N, H, W, C), (R, S, C / G, K), strides, padding, groups, activation: plain, strided,
# grouped (narrow groups), depthwise (strided), pointwise.
_CONV_CASES = {
    "plain": ((2, 16, 16, 32), (3, 3, 32, 64), 1, "SAME", 1, "relu"),
    "strided": ((2, 17, 17, 32), (3, 3, 32, 48), 2, "SAME", 1, "gelu"),
    "grouped": ((2, 14, 14, 64), (3, 3, 8, 64), 1, "SAME", 8, None),
    "depthwise": ((2, 15, 15, 64), (3, 3, 1, 64), 2, "SAME", 64, "relu"),
    "pointwise": ((4, 8, 8, 64), (1, 1, 64, 128), 1, "VALID", 1, "tanh"),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(_CONV_CASES))
def test_conv_bitwise_equal_sync_and_async(async_mode, case, dtype):
    xs, ws, stride, padding, groups, act = _CONV_CASES[case]
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal(xs), dtype)
    w = jnp.asarray(rng.standard_normal(ws) / 8, dtype)
    b = jnp.asarray(rng.standard_normal(ws[-1]), jnp.float32)

    def loss(x, w, b):  # the forward, and the backward and update passes of its gradients
        y = jb.conv2d(x, w, b, strides=stride, padding=padding, activation=act, feature_group_count=groups)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    _twice(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), x, w, b)


def test_conv_network_bitwise_equal_sync_and_async(async_mode):
    """A few layers whose calls overlap: a small ResNet-like stack, value and gradients."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((4, 16, 16, 16)), jnp.float32)
    shapes = [((3, 3, 16, 32), 1, 1), ((3, 3, 4, 32), 1, 8), ((3, 3, 1, 32), 2, 32), ((1, 1, 32, 64), 1, 1)]
    params = [jnp.asarray(rng.standard_normal(s) / 8, jnp.float32) for s, _, _ in shapes]

    def loss(params, x):
        for w, (_, stride, groups) in zip(params, shapes):
            x = jb.conv2d(x, w, strides=stride, activation="relu", feature_group_count=groups)
        return jnp.sum(x ** 2)

    _twice(jax.jit(jax.value_and_grad(loss)), params, x)
