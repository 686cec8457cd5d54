"""jax_brgemm.accelerate() over the recurrent patterns of Flax's linen examples: nn.Bidirectional,
nn.scan over an LSTM cell (sst2) and seq2seq's encoder (seq_lengths with return_carry) fused,
and the patterns that stay stock (a scan with per-step parameters, a scan over a method, a
custom cell, seq_lengths with return_carry over two batch dims) listed with their reasons, the
layers inside them marked as per-step work rather than counted as accelerated recurrent
layers."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb


def _close(a, b, tol=2e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=tol, atol=tol)


def _fused_twice(model, x):
    """The accelerated calls of model on x, after its outputs and gradients matched stock
    and its program called the LSTM kernel twice."""
    params = model.init(jax.random.key(1), x)
    loss = lambda p: jnp.sum(model.apply(p, x) ** 2)  # noqa: E731
    with jb.accelerate() as acc:
        y = jax.jit(model.apply)(params, x)
        g = jax.jit(jax.grad(loss))(params)
        hlo = jax.jit(model.apply).lower(params, x).as_text()
    _close(y, model.apply(params, x))
    _close(g, jax.grad(loss)(params), 1e-4)
    assert hlo.count("jb_lstm_fwd") == 2
    return acc.calls


# made when the test module is imported, before any accelerate() context: found all the same
ModuleLevelScan = nn.scan(nn.LSTMCell, variable_broadcast="params", split_rngs={"params": False},
                          in_axes=1, out_axes=1)


class SST2Encoder(nn.Module):  # flax's sst2 example: a bidirectional nn.scan over a cell
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params",
                       split_rngs={"params": False}, in_axes=1, out_axes=1)
        carry = nn.OptimizedLSTMCell(6, parent=None).initialize_carry(
            jax.random.key(0), x[:, 0].shape)
        _, forward = scan(features=6, name="forward")(carry, x)
        _, backward = ModuleLevelScan(features=6, name="backward")(carry, x[:, ::-1])
        return nn.Dense(2)(jnp.concatenate([forward, backward[:, ::-1]], -1))


def test_sst2_scan_runs_fused():
    calls = _fused_twice(SST2Encoder(), jax.random.normal(jax.random.key(0), (3, 5, 4)))
    assert [(c.path, c.layer, c.accelerated) for c in calls] == [
        ("forward", "nn.scan(OptimizedLSTMCell)", True), ("backward", "nn.scan(LSTMCell)", True),
        ("Dense_0", "Dense", True)]


def _scan_model(cell, features=5, **settings):
    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, carry, x):
            return nn.scan(cell, **settings)(features, dtype=x.dtype, name="lstm")(carry, x)

    return Scanned()


@pytest.mark.parametrize("axes", [(1, 1), (0, 0), (1, 0), (0, -2), ((1,), 1)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("cell", [nn.OptimizedLSTMCell, nn.LSTMCell])
def test_scan_settings_fused_as_stock_computes_them(axes, reverse, cell):
    model = _scan_model(cell, variable_broadcast="params", split_rngs={"params": False},
                        in_axes=axes[0], out_axes=axes[1], reverse=reverse)
    x = jax.random.normal(jax.random.key(0), (4, 3, 2))  # time is axis 0 or 1
    time_axis = axes[0][0] if isinstance(axes[0], tuple) else axes[0]
    batch = x.shape[1 - time_axis]
    carry = tuple(jax.random.normal(jax.random.key(k), (batch, 5)) for k in (1, 2))
    params = model.init(jax.random.key(3), carry, x)
    with jb.accelerate() as acc:
        got = jax.jit(model.apply)(params, carry, x)
    _close(got, model.apply(params, carry, x))
    assert [(c.layer, c.accelerated) for c in acc.calls] == [(f"nn.scan({cell.__name__})", True)]


def test_bfloat16_scan_fused():
    model = _scan_model(nn.OptimizedLSTMCell, variable_broadcast="params",
                        split_rngs={"params": False}, in_axes=1, out_axes=1)
    x = jax.random.normal(jax.random.key(0), (3, 4, 2)).astype(jnp.bfloat16)
    carry = (jnp.zeros((3, 5), jnp.bfloat16),) * 2
    params = model.init(jax.random.key(1), carry, x)
    with jb.accelerate() as acc:
        got = jax.jit(model.apply)(params, carry, x)
    want = model.apply(params, carry, x)
    assert [a.dtype for a in jax.tree_util.tree_leaves(got)] == [
        a.dtype for a in jax.tree_util.tree_leaves(want)]
    _close(got, want, 5e-2)
    assert acc.calls[0].accelerated


@pytest.mark.parametrize("settings, shape, reason", [
    (dict(variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=1, out_axes=1),
     (2, 3, 4), "not variable_broadcast"),
    (dict(variable_broadcast="params", split_rngs={"params": False}, in_axes=2, out_axes=2),
     (2, 3, 2, 4), "3-D"),
])
def test_other_scans_stock_with_their_reason(settings, shape, reason):
    model = _scan_model(nn.LSTMCell, **settings)
    x = jax.random.normal(jax.random.key(0), shape)
    time_axis = settings["in_axes"]
    batch_shape = tuple(n for i, n in enumerate(x.shape[:-1]) if i != time_axis)
    carry = (jnp.zeros(batch_shape + (5,)),) * 2
    params = model.init(jax.random.key(1), carry, x)
    with jb.accelerate() as acc:
        got = model.apply(params, carry, x)
    _close(got, model.apply(params, carry, x))
    scans = [c for c in acc.calls if c.layer == "nn.scan(LSTMCell)"]
    assert len(scans) == 1 and not scans[0].accelerated and reason in scans[0].reason
    # the cell's per-step Dense layers say which stock scan they are steps of
    assert all(c.step_of.startswith("lstm [nn.scan(LSTMCell)]") for c in acc.calls
               if c.layer == "Dense")


class ScannedMethod(nn.Module):  # flax's sst2 SimpleLSTM: nn.scan over a method, listed stock
    @functools.partial(nn.scan, variable_broadcast="params", in_axes=1, out_axes=1,
                       split_rngs={"params": False})
    @nn.compact
    def __call__(self, carry, x):
        return nn.OptimizedLSTMCell(6)(carry, x)


def test_scan_over_a_method_listed_as_stock_with_its_reason():
    model, x = ScannedMethod(), jax.random.normal(jax.random.key(0), (3, 5, 4))
    carry = (jnp.zeros((3, 6)),) * 2
    params = model.init(jax.random.key(1), carry, x)
    with jb.accelerate() as acc:
        y = jax.jit(model.apply)(params, carry, x)
    _close(y, model.apply(params, carry, x))
    assert [(c.layer, c.accelerated) for c in acc.calls] == [("OptimizedLSTMCell", False)]
    assert "step by step" in acc.calls[0].reason


def test_bidirectional_runs_both_directions_fused():
    model = nn.Bidirectional(nn.RNN(nn.OptimizedLSTMCell(5)), nn.RNN(nn.LSTMCell(5)))
    calls = _fused_twice(model, jax.random.normal(jax.random.key(0), (2, 6, 3)))
    assert [(c.layer, c.accelerated) for c in calls] == [("RNN", True), ("RNN", True)]


class DecoderCell(nn.RNNCellBase):  # a custom cell, as in flax's seq2seq example
    features: int = 4

    @nn.compact
    def __call__(self, carry, x):
        h = nn.tanh(nn.Dense(self.features)(jnp.concatenate([carry, x], -1)))
        return h, h

    def initialize_carry(self, rng, input_shape):
        return jnp.zeros(input_shape[:-1] + (self.features,))

    @property
    def num_feature_axes(self):
        return 1


def test_seq2seq_encoder_fused_decoder_stock_with_per_step_layers_marked():
    x = jax.random.normal(jax.random.key(0), (2, 5, 3))
    lengths = jnp.array([5, 3])
    encoder = nn.RNN(nn.LSTMCell(4), return_carry=True)
    decoder = nn.RNN(DecoderCell())
    pe, pd = encoder.init(jax.random.key(1), x), decoder.init(jax.random.key(2), x)
    with jb.accelerate() as acc:
        carry, _ = encoder.apply(pe, x, seq_lengths=lengths)
        y = decoder.apply(pd, x)
    _close(carry, encoder.apply(pe, x, seq_lengths=lengths)[0])
    _close(y, decoder.apply(pd, x))
    rnns = [c for c in acc.calls if c.layer == "RNN"]
    assert [(c.accelerated, c.reason) for c in rnns] == [(True, ""), (False, "cell DecoderCell")]
    dense = [c for c in acc.calls if c.layer == "Dense"]
    assert len(dense) == 1 and all(c.accelerated and "RNN over" in c.step_of for c in dense)
    summary = acc.summary()
    assert "1 of them are layers inside stock recurrent scans" in summary


class Seq2SeqEncoder(nn.Module):  # flax's seq2seq encoder: each sequence's own last carry
    cell: type = nn.OptimizedLSTMCell
    time_major: bool = False
    reverse: bool = False

    @nn.compact
    def __call__(self, x, lengths):
        rnn = nn.RNN(self.cell(6), return_carry=True, time_major=self.time_major,
                     reverse=self.reverse, keep_order=self.reverse)
        (c, h), y = rnn(x, seq_lengths=lengths)
        return nn.Dense(2)(jnp.concatenate([c, h], -1)), y


@pytest.mark.parametrize("cell,time_major,reverse", [
    (nn.OptimizedLSTMCell, False, False), (nn.LSTMCell, True, False),
    (nn.OptimizedLSTMCell, False, True)])
def test_seq2seq_encoder_carry_and_gradients_fused(cell, time_major, reverse):
    model = Seq2SeqEncoder(cell, time_major, reverse)
    x = jax.random.normal(jax.random.key(0), (7, 5, 3) if time_major else (5, 7, 3))
    lengths = jnp.array([7, 1, 4, 0, 9])  # 0 and 9: the last step's carry, as stock reads them
    params = model.init(jax.random.key(1), x, lengths)

    def loss(p):
        out, y = model.apply(p, x, lengths)
        return jnp.sum(jnp.sin(out)) + jnp.sum(y ** 2)

    with jb.accelerate() as acc:
        got = jax.jit(model.apply)(params, x, lengths)
        grads = jax.jit(jax.grad(loss))(params)
        hlo = jax.jit(jax.grad(loss)).lower(params).as_text()
    _close(got, model.apply(params, x, lengths))
    _close(grads, jax.grad(loss)(params), 1e-4)
    assert hlo.count("jb_lstm_fwd") == 1 and hlo.count("jb_lstm_bptt") == 1
    assert [(c.layer, c.accelerated) for c in acc.calls] == [("RNN", True), ("Dense", True)]


def test_seq_lengths_with_return_carry_over_two_batch_dims_stock_with_its_reason():
    rnn = nn.RNN(nn.OptimizedLSTMCell(4), return_carry=True)
    x = jax.random.normal(jax.random.key(0), (2, 2, 5, 3))
    lengths = jnp.array([5, 3])  # flax selects along the first batch dim only
    params = rnn.init(jax.random.key(1), x)
    with jb.accelerate() as acc:
        got = rnn.apply(params, x, seq_lengths=lengths)
    _close(got, rnn.apply(params, x, seq_lengths=lengths))
    rnns = [c for c in acc.calls if c.layer == "RNN"]
    assert [(c.accelerated, c.reason) for c in rnns] == [
        (False, "seq_lengths with return_carry over 2 batch dims, not one")]
