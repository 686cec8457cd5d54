"""Forward mode through the modules and accelerate(): jax.jvp, jax.linearize and
Hessian-vector products (jvp of grad) of unmodified Flax models (linen: Conv, Dense,
attention, LSTM; NNX: Conv, Linear, attention) inside jb.accelerate() equal stock, under jit,
vmap, nn.scan and remat, with the kernels in the programs; and jb.nn's own modules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_brgemm as jb


class ConvDense(nn.Module):  # the model: a linen Conv + Dense
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(6, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2)).reshape((x.shape[0], -1))
        return nn.Dense(5)(x)


class Everything(nn.Module):  # Conv, Dense, attention and an LSTM in one model
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))                      # (N, 6, 5, 8)
        x = x.reshape((x.shape[0], x.shape[1], -1))             # (N, 6, 40): 6 tokens
        x = nn.Dense(16)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(x)
        x = nn.RNN(nn.OptimizedLSTMCell(12))(x)
        return nn.Dense(3)(x[:, -1])


class Scanned(nn.Module):  # nn.scan over a Dense, then a rematerialized Dense
    @nn.compact
    def __call__(self, x):
        cell = nn.scan(lambda mdl, c, _: (nn.tanh(mdl(c)), None), variable_broadcast="params",
                       split_rngs={"params": False}, length=3)
        x, _ = cell(nn.Dense(7), x, None)
        return nn.remat(nn.Dense)(4)(x)


def close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * max(1.0, float(np.abs(y).max(initial=0))))


def scalar(f):
    return lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))


def modes(f, params, x):
    """(jvp, linearize, HVP in the parameters) of f(params, x) for fixed tangents."""
    tp = jax.tree.map(lambda p: 0.5 * jnp.cos(p), params)
    tx = 0.3 * x
    y, t = jax.jit(lambda p, x, tp, tx: jax.jvp(f, (p, x), (tp, tx)))(params, x, tp, tx)
    _, lin = jax.linearize(f, params, x)
    hvp = jax.jit(lambda p, tp: jax.jvp(jax.grad(scalar(f)), (p, x), (tp, tx))[1])(params, tp)
    return y, t, lin(tp, tx), hvp


def kernel_text(f, params, x):
    tp = jax.tree.map(jnp.ones_like, params)
    hvp = lambda p, tp: jax.jvp(jax.grad(scalar(f)), (p, x), (tp, 0.3 * x))[1]  # noqa: E731
    return jax.jit(hvp).lower(params, tp).as_text()


@pytest.mark.parametrize("model,shape,targets,tol", [
    (ConvDense(), (2, 8, 7, 3), ["jb_conv_fwd", "jb_fc_fwd"], 1e-4),
    (Everything(), (2, 8, 7, 2), ["jb_conv_fwd", "jb_fc_fwd", "jb_attention_fwd", "jb_lstm_fwd", "jb_lstm_tangent"],
     2e-4),
    (Scanned(), (5, 7), ["jb_fc_fwd"], 1e-4),
])
def test_linen_model_forward_mode_and_hvp(model, shape, targets, tol):
    x = jax.random.normal(jax.random.key(0), shape)
    params = model.init(jax.random.key(1), x)
    stock = modes(model.apply, params, x)
    with jb.accelerate() as acc:
        fast = modes(model.apply, params, x)
        text = kernel_text(model.apply, params, x)
    assert acc.calls and all(c.accelerated for c in acc.calls), [str(c) for c in acc.calls]
    for got, want in zip(fast, stock, strict=True):
        close(got, want, tol)
    assert all(f"custom_call @{t}" in text for t in targets)


def test_linen_bfloat16_forward_mode():
    model = nn.Dense(9, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (6, 11))
    params = model.init(jax.random.key(1), x)
    stock = modes(model.apply, params, x)
    with jb.accelerate():
        fast = modes(model.apply, params, x)
    assert fast[1].dtype == jnp.bfloat16
    for got, want in zip(fast, stock, strict=True):
        close(got, want, 5e-2)


@pytest.mark.slow  # the quick tier's vmap orders are test_forward_mode.py's
def test_vmap_of_hvp_and_hvp_of_vmap():
    model = ConvDense()
    x = jax.random.normal(jax.random.key(0), (3, 2, 8, 7, 3))
    params = model.init(jax.random.key(1), x[0])
    tp = jax.tree.map(lambda p: 0.5 * jnp.cos(p), params)

    def hvp(apply):
        per = lambda x: jax.jvp(jax.grad(lambda p: scalar(apply)(p, x)), (params,), (tp,))[1]  # noqa: E731
        whole = jax.jvp(jax.grad(lambda p: scalar(jax.vmap(apply, (None, 0)))(p, x)), (params,), (tp,))[1]
        return jax.jit(jax.vmap(per))(x), whole

    stock = hvp(model.apply)
    with jb.accelerate():
        fast = hvp(model.apply)
    close(fast, stock, 1e-4)


class NnxModel(nnx.Module):
    def __init__(self, *, rngs):
        self.conv = nnx.Conv(3, 6, (3, 3), rngs=rngs)
        self.attention = nnx.MultiHeadAttention(2, 6, decode=False, rngs=rngs)
        self.linear = nnx.Linear(6, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv(x)).reshape((x.shape[0], -1, 6))
        return self.linear(x + self.attention(x))


def test_nnx_model_forward_mode_and_hvp():
    graphdef, params = nnx.split(NnxModel(rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(2), (2, 4, 3, 3))
    apply = lambda p, x: nnx.merge(graphdef, p)(x)  # noqa: E731
    stock = modes(apply, params, x)
    with jb.accelerate() as acc:
        fast = modes(apply, params, x)
        text = kernel_text(apply, params, x)
    assert acc.calls and all(c.accelerated for c in acc.calls), [str(c) for c in acc.calls]
    close(fast, stock, 2e-4)
    assert all(f"custom_call @{t}" in text for t in ("jb_conv_fwd", "jb_fc_fwd", "jb_attention_fwd"))


def test_jb_nn_modules_forward_mode():
    """The package's own modules (no context): Dense with a fused activation, and LSTM."""
    x = jax.random.normal(jax.random.key(0), (2, 5, 4))
    dense, lstm = nn.Dense(6), nn.RNN(nn.OptimizedLSTMCell(3))
    for ours, stock in ((jb.nn.Dense(6, activation="gelu"), lambda p, x: jax.nn.gelu(dense.apply(p, x))),
                        (jb.nn.LSTM(3), lstm.apply)):
        params = ours.init(jax.random.key(1), x)
        close(modes(ours.apply, params, x), modes(stock, params, x), 1e-4)
    assert "custom_call @jb_lstm_tangent" in kernel_text(jb.nn.LSTM(3).apply, params, x)


def test_nnx_lstm_forward_mode_and_hvp():
    """jax_brgemm.nnx.LSTM, and a stock nnx.RNN over OptimizedLSTMCell inside accelerate():
    jvp, linearize and HVP equal stock's, the LSTM's tangent on the kernels."""
    x = jax.random.normal(jax.random.key(0), (3, 5, 4))
    carry = tuple(jax.random.normal(jax.random.key(i), (3, 7)) for i in (1, 2))  # no carry rngs drawn

    def split(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return (lambda p, x: nnx.merge(graphdef, p, rest)(x, initial_carry=carry)), params

    stock, params = split(nnx.RNN(nnx.OptimizedLSTMCell(4, 7, rngs=nnx.Rngs(5))))
    ours, ours_params = split(jb.nnx.LSTM(4, 7, rngs=nnx.Rngs(5)))
    want = modes(stock, params, x)
    close(modes(ours, ours_params, x), want, 1e-4)
    assert "custom_call @jb_lstm_tangent" in kernel_text(ours, ours_params, x)
    with jb.accelerate() as acc:
        fast = modes(stock, params, x)
        text = kernel_text(stock, params, x)
    assert acc.calls and all(c.accelerated for c in acc.calls), [str(c) for c in acc.calls]
    close(fast, want, 1e-4)
    assert "custom_call @jb_lstm_tangent" in text
