"""jax_brgemm.accelerate(): unmodified Flax models, written as in the Flax examples, give the
stock outputs, gradients and parameter trees, with their Dense and Conv layers on the kernels."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64)(x))
        x = nn.gelu(nn.Dense(33, use_bias=False)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):  # the Flax MNIST example's model
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(features=8, kernel_size=(3, 3))(x))
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(features=16, kernel_size=(3, 3))(x))
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(features=32)(x))
        return nn.Dense(features=10)(x)


class ResBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool):
        y = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        y = nn.BatchNorm(use_running_average=not train)(y)
        return nn.relu(x + y)


class SmallResNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = ResBlock(8)(nn.relu(x), train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(10)(x)


def _close(a, b, tol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol)


def _loss(model, **kw):
    return lambda params, x: jnp.sum(model.apply(params, x, **kw) ** 2)


@pytest.mark.parametrize("model,shape,fast_calls,targets", [
    (MLP(), (5, 7, 3), 3, ["jb_fc_fwd"]),
    (CNN(), (2, 12, 12, 1), 4, ["jb_fc_fwd", "jb_conv_fwd"])])
def test_same_outputs_gradients_and_trees(model, shape, fast_calls, targets):
    x = jax.random.normal(jax.random.key(0), shape)
    params = model.init(jax.random.key(1), x)
    with jb.accelerate() as acc:
        inside = model.init(jax.random.key(1), x)
        y = jax.jit(model.apply)(params, x)
        g = jax.jit(jax.grad(_loss(model)))(params, x)
    assert jax.tree_util.tree_structure(inside) == jax.tree_util.tree_structure(params)
    _close(inside, params, 0)  # init runs the stock code: identical parameters
    _close(y, model.apply(params, x), 2e-5)
    _close(g, jax.grad(_loss(model))(params, x), 1e-4)
    assert sum(c.accelerated for c in acc.calls) == fast_calls == len(acc.calls)
    # the kernels really ran: their custom calls are in the compiled programs
    with jb.accelerate():
        hlo = jax.jit(model.apply).lower(params, x).as_text()
        grad_hlo = jax.jit(jax.grad(_loss(model))).lower(params, x).as_text()
    assert all(t in hlo for t in targets)
    if "jb_conv_fwd" in targets:
        assert "jb_conv_bwd" in grad_hlo and "jb_conv_upd" in grad_hlo


def test_batchnorm_model_train_and_eval_mode():
    model = SmallResNet()
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    variables = model.init(jax.random.key(1), x)

    def train_loss(params, stats):
        y, new = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
        return jnp.sum(y ** 2), new

    stock = jax.grad(train_loss, has_aux=True)(variables["params"], variables["batch_stats"])
    with jb.accelerate() as acc:
        fast = jax.jit(jax.grad(train_loss, has_aux=True))(variables["params"], variables["batch_stats"])
        y_eval = jax.jit(lambda v: model.apply(v, x, train=False))(variables)
    _close(fast, stock, 1e-4)
    _close(y_eval, model.apply(variables, x, train=False), 2e-5)
    assert [c.path for c in acc.calls if c.accelerated] == ["Conv_0", "ResBlock_0/Conv_0", "Dense_0"]
    assert len(acc.calls) == 3


def test_bfloat16_layers():
    model = nn.Dense(24, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (6, 40))
    params = model.init(jax.random.key(1), x)
    with jb.accelerate() as acc:
        y = jax.jit(model.apply)(params, x)
        g = jax.grad(lambda p: jnp.sum(model.apply(p, x).astype(jnp.float32) ** 2))(params)
    assert y.dtype == jnp.bfloat16 and acc.calls[0].accelerated
    _close(y, model.apply(params, x), 3e-2)
    want = jax.grad(lambda p: jnp.sum(model.apply(p, x).astype(jnp.float32) ** 2))(params)
    assert jax.tree_util.tree_map(lambda a: a.dtype, g) == jax.tree_util.tree_map(lambda a: a.dtype, want)
    _close(g, want, 5e-2)


def test_vmap_scan_and_remat():
    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            cell = nn.scan(lambda mdl, c, _: (nn.tanh(mdl(c)), None), variable_broadcast="params",
                           split_rngs={"params": False}, length=3)
            x, _ = cell(nn.Dense(16), x, None)
            return nn.remat(nn.Dense)(4)(x)

    model = Scanned()
    x = jax.random.normal(jax.random.key(0), (5, 16))
    params = model.init(jax.random.key(1), x)
    batched = jnp.stack([x, 2 * x])
    with jb.accelerate() as acc:
        y = jax.jit(jax.vmap(model.apply, in_axes=(None, 0)))(params, batched)
        g = jax.grad(_loss(model))(params, x)
    assert all(c.accelerated for c in acc.calls) and len(acc.calls) == 2
    _close(y, jax.vmap(model.apply, in_axes=(None, 0))(params, batched), 2e-5)
    _close(g, jax.grad(_loss(model))(params, x), 1e-4)


def test_unsupported_configurations_run_stock_and_say_why(capsys):
    custom = nn.Dense(8, dot_general=lambda a, b, dims, precision=None: jax.lax.dot_general(a, b, dims) * 2)
    x = jnp.ones((3, 5))
    p = custom.init(jax.random.key(0), x)
    half = nn.Dense(4, dtype=jnp.float16, param_dtype=jnp.float16)
    xh = jnp.ones((2, 3), jnp.float16)
    ph = half.init(jax.random.key(0), xh)
    with jb.accelerate(report=True) as acc:
        y = custom.apply(p, x)
        yh = half.apply(ph, xh)
    np.testing.assert_allclose(y, custom.apply(p, x))
    np.testing.assert_array_equal(yh, half.apply(ph, xh))
    assert [c.reason for c in acc.calls] == ["custom dot_general", "float16 computation"]
    out = capsys.readouterr().out
    assert "0 of 2 layer calls on the kernels" in out and "custom dot_general" in out


def test_decorator_and_outside_the_context_is_stock():
    model = MLP()
    x = jnp.ones((2, 6))
    params = model.init(jax.random.key(0), x)

    @jb.accelerate()
    def hlo():
        return jax.jit(model.apply).lower(params, x).as_text()

    assert "jb_fc_fwd" in hlo()
    assert "jb_fc_fwd" not in jax.jit(model.apply).lower(params, x).as_text()


def test_conv_forms_and_fallbacks_say_why():
    """Conv and ConvTranspose calls in every supported form run on the kernels with the stock
    results; 4-D and a custom conv run stock, each with its reason."""
    x = jax.random.normal(jax.random.key(0), (2, 9, 8, 4))
    mask = (jnp.arange(3 * 3 * 4 * 6).reshape(3, 3, 4, 6) % 3 != 0).astype(jnp.float32)
    fast = [nn.Conv(6, (3, 3), strides=2, padding="VALID"),
            nn.Conv(6, (1, 3), padding=((1, 0), (2, 1)), use_bias=False),
            nn.Conv(6, (3, 3), padding="CIRCULAR"),
            nn.Conv(6, (3, 3), mask=mask),
            nn.Conv(5, 3, padding="CAUSAL"),  # 1-D over the rows of each image
            nn.Conv(6, (3, 3), kernel_dilation=2),
            nn.Conv(6, (3, 3), feature_group_count=2),
            nn.Conv(6, (3, 3), padding=((1, 1), (1, 1)), input_dilation=2),
            nn.Conv(6, (3, 3), padding=((1, 1), (1, 1)), input_dilation=2, strides=2),
            nn.Conv(6, (3, 3), padding=((-1, 2), (1, -2)), input_dilation=(2, 3)),
            nn.ConvTranspose(6, (3, 3), strides=2),
            nn.ConvTranspose(6, (3, 2), strides=(1, 2), padding="CIRCULAR", transpose_kernel=True)]
    slow = [(nn.Conv(6, (1, 1, 1, 1)), "4-D convolution", x.reshape(2, 9, 8, 1, 1, 4)),
            (nn.Conv(6, (3, 3), conv_general_dilated=jax.lax.conv_general_dilated),
             "custom conv_general_dilated", x)]
    for layer, reason, x in [(f, "", x) for f in fast] + slow:
        params = layer.init(jax.random.key(1), x)
        loss = lambda p: jnp.sum(jnp.tanh(layer.apply(p, x)))  # noqa: E731
        with jb.accelerate() as acc:
            y = jax.jit(layer.apply)(params, x)
            g = jax.grad(loss)(params)
        want = layer.apply(params, x)
        assert y.shape == want.shape
        _close(y, want, 2e-5)
        _close(g, jax.grad(loss)(params), 1e-4)
        (call,) = acc.calls
        assert call.accelerated == (not reason) and call.reason == reason, call


class RNNClassifier(nn.Module):  # an RNN classifier as in the Flax docs: stacked RNNs + Dense
    cell: type = nn.OptimizedLSTMCell

    @nn.compact
    def __call__(self, x):
        x = nn.RNN(self.cell(16))(x)
        x = nn.RNN(self.cell(12))(x)
        return nn.Dense(10)(x[:, -1])


@pytest.mark.slow  # 21-24 s a cell; the quick tier runs linen RNNs in test_accelerate_scans.py
@pytest.mark.parametrize("cell", [nn.OptimizedLSTMCell, nn.LSTMCell])
def test_rnn_classifier_same_outputs_gradients_and_trees(cell):
    model = RNNClassifier(cell)
    x = jax.random.normal(jax.random.key(0), (3, 5, 7))
    params = model.init(jax.random.key(1), x)
    with jb.accelerate() as acc:
        inside = model.init(jax.random.key(1), x)
        y = jax.jit(model.apply)(params, x)
        g = jax.jit(jax.grad(_loss(model)))(params, x)
        hlo = jax.jit(model.apply).lower(params, x).as_text()
    assert jax.tree_util.tree_structure(inside) == jax.tree_util.tree_structure(params)
    _close(inside, params, 0)
    _close(y, model.apply(params, x), 2e-5)
    _close(g, jax.grad(_loss(model))(params, x), 1e-4)
    assert [(c.layer, c.accelerated) for c in acc.calls] == [("RNN", True), ("RNN", True), ("Dense", True)]
    assert "jb_lstm_fwd" in hlo


def test_both_lstm_cells_have_one_parameter_tree():
    x = jnp.ones((2, 4, 3))
    trees = [jax.tree_util.tree_map(jnp.shape, nn.RNN(c(5)).init(jax.random.key(0), x))
             for c in (nn.OptimizedLSTMCell, nn.LSTMCell)]
    assert trees[0] == trees[1]


def test_rnn_carry_reverse_time_major_and_bf16():
    x = jax.random.normal(jax.random.key(0), (6, 2, 3))  # time-major
    rnn = nn.RNN(nn.OptimizedLSTMCell(4), time_major=True, return_carry=True, reverse=True,
                 keep_order=True)
    params = rnn.init(jax.random.key(1), x)
    carry0 = (jnp.full((2, 4), 0.3), jnp.full((2, 4), -0.2))
    bf16 = nn.RNN(nn.LSTMCell(4, dtype=jnp.bfloat16))
    xb = jnp.moveaxis(x, 0, 1)
    with jb.accelerate() as acc:
        got = jax.jit(lambda p, x, c: rnn.apply(p, x, initial_carry=c))(params, x, carry0)
        gb = bf16.apply(params, xb)
    _close(got, rnn.apply(params, x, initial_carry=carry0), 2e-5)
    assert gb.dtype == bf16.apply(params, xb).dtype
    _close(gb, bf16.apply(params, xb), 3e-2)
    assert all(c.accelerated for c in acc.calls)


def test_rnn_unsupported_run_stock_and_say_why():
    x = jax.random.normal(jax.random.key(0), (1, 2, 4, 3))  # seq_lengths over two batch dims
    lengths = jnp.array([4, 2])
    rnn = nn.RNN(nn.OptimizedLSTMCell(5), return_carry=True)
    relu_cell = nn.RNN(nn.LSTMCell(5, activation_fn=nn.relu))
    gru = nn.RNN(nn.GRUCell(5))
    p, pr, pg = (m.init(jax.random.key(1), x) for m in (rnn, relu_cell, gru))
    with jb.accelerate() as acc:
        a = rnn.apply(p, x, seq_lengths=lengths)
        b = relu_cell.apply(pr, x)
        c = gru.apply(pg, x)
    _close(a, rnn.apply(p, x, seq_lengths=lengths), 0)
    # the stock LSTMCell / GRUCell run their Dense layers, which run on the kernels
    _close(b, relu_cell.apply(pr, x), 2e-5)
    _close(c, gru.apply(pg, x), 2e-5)
    reasons = [c.reason for c in acc.calls if c.layer == "RNN"]
    assert reasons == ["seq_lengths with return_carry over 2 batch dims, not one",
                       "gate_fn / activation_fn other than sigmoid / tanh", "cell GRUCell"]
