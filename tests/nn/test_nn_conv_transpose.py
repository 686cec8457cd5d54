"""jb.nn.ConvTranspose and stock flax.linen.ConvTranspose under accelerate() against
flax.linen.ConvTranspose: 1-D, 2-D and 3-D, strides, kernel dilation, every padding form
(SAME, VALID, CIRCULAR, explicit and negative pads), transpose_kernel, masks, batch dims,
fp32 and bf16; outputs and gradients, on the kernels; and 3-D and grouped convolutions of
stock models under accelerate()."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb


def close(a, b, tol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, atol=tol * (1 + np.abs(y).max(initial=0)), rtol=tol)


def on_kernels(apply, *args) -> bool:
    return "custom_call @jb_conv" in jax.jit(apply).lower(*args).as_text()


# (kernel size, fields, input shape)
CASES = [
    ((3, 3), dict(strides=2), (2, 5, 7, 4)),
    ((2, 4), dict(strides=(2, 1), padding="VALID"), (2, 6, 5, 4)),
    ((3, 3), dict(strides=3, kernel_dilation=2, padding=((1, 2), (0, 1))), (1, 4, 5, 3)),
    ((3, 3), dict(strides=2, padding="CIRCULAR"), (2, 5, 6, 4)),
    ((3, 2), dict(strides=(3, 2), padding="CIRCULAR", transpose_kernel=True), (2, 4, 5, 3)),
    ((3, 3), dict(strides=2, padding=((-1, 2), (0, -1))), (2, 6, 6, 4)),
    ((4, 4), dict(strides=2, padding="SAME", transpose_kernel=True, use_bias=False), (1, 8, 8, 8)),
    ((5,), dict(strides=2), (3, 9, 4)),                                  # 1-D
    ((3,), dict(strides=1, padding="VALID"), (2, 3, 7, 4)),             # 1-D, two batch dims
    ((3, 3), dict(strides=1), (6, 6, 3)),                                # no batch dim
    ((3, 3, 3), dict(strides=2), (1, 3, 4, 5, 2)),                      # 3-D
    ((2, 3, 1), dict(strides=(1, 2, 3), padding="VALID", transpose_kernel=True), (2, 3, 3, 2, 3)),
]


@pytest.mark.parametrize("kernel_size,kw,shape", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_module_and_accelerate_match_flax(kernel_size, kw, shape, dtype):
    x = jax.random.normal(jax.random.key(0), shape)
    stock = nn.ConvTranspose(5, kernel_size, dtype=dtype, **kw)
    ours = jb.nn.ConvTranspose(5, kernel_size, dtype=dtype, activation="tanh", **kw)
    params = stock.init(jax.random.key(1), x)
    assert jax.tree_util.tree_map(jnp.shape, ours.init(jax.random.key(1), x)) == jax.tree_util.tree_map(
        jnp.shape, params)
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    want = jnp.tanh(stock.apply(params, x))
    assert on_kernels(ours.apply, params, x)
    close(jax.jit(ours.apply)(params, x), want, tol)
    with jb.accelerate() as acc:
        close(jax.jit(stock.apply)(params, x), stock.apply(params, x), tol)
        grads = jax.grad(lambda p, x: jnp.sum(jnp.sin(stock.apply(p, x))), argnums=(0, 1))(params, x)
    assert [c.accelerated for c in acc.calls] == [True]
    want = jax.grad(lambda p, x: jnp.sum(jnp.sin(stock.apply(p, x))), argnums=(0, 1))(params, x)
    close(grads, want, 30 * tol)


def test_mask_and_transpose_kernel():
    x = jax.random.normal(jax.random.key(0), (2, 5, 5, 3))
    mask = (jnp.arange(3 * 2 * 4 * 3).reshape(3, 2, 4, 3) % 3 != 0).astype(jnp.float32)
    stock = nn.ConvTranspose(4, (3, 2), strides=2, mask=mask, transpose_kernel=True)
    ours = jb.nn.ConvTranspose(4, (3, 2), strides=2, mask=mask, transpose_kernel=True)
    params = stock.init(jax.random.key(1), x)
    assert on_kernels(ours.apply, params, x)
    close(ours.apply(params, x), stock.apply(params, x), 2e-5)


def test_stock_models_with_every_kind_run_on_the_kernels():
    """A stock linen model of 3-D, grouped, depthwise, input-dilated and transposed layers:
    every call on the kernels, the same outputs and gradients."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(8, (3, 3, 3))(x))
            x = nn.Conv(8, (3, 3, 3), feature_group_count=8, strides=(1, 2, 2))(x)
            x = nn.ConvTranspose(4, (2, 2, 2), strides=(1, 2, 2))(x)
            x = nn.Conv(4, (3, 3), input_dilation=2, strides=2, padding=((1, 1), (1, 1)))(x[:, 0])
            return nn.Conv(6, (3, 3), feature_group_count=2, kernel_dilation=2)(x)

    x = jax.random.normal(jax.random.key(0), (2, 3, 6, 6, 4))
    model = Model()
    params = model.init(jax.random.key(1), x)
    loss = lambda p: jnp.sum(jnp.sin(model.apply(p, x)))  # noqa: E731
    with jb.accelerate() as acc:
        y = jax.jit(model.apply)(params, x)
        g = jax.jit(jax.grad(loss))(params)
    assert len(acc.calls) == 5 and all(c.accelerated for c in acc.calls), acc.summary()
    close(y, model.apply(params, x), 2e-5)
    close(g, jax.grad(loss)(params), 1e-4)
