"""jax_brgemm.accelerate() over the recurrent patterns of Flax's linen examples: nn.Bidirectional
over fused LSTMs, and the patterns that stay stock (sst2's nn.scan over a cell, seq2seq's
seq_lengths with return_carry, a custom cell) listed with their reasons, the layers inside
them marked as per-step work rather than counted as accelerated recurrent layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jax_brgemm as jb


def _close(a, b, tol=2e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=tol, atol=tol)


class SST2Encoder(nn.Module):  # flax's sst2 example: a bidirectional nn.scan over a cell
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params",
                       split_rngs={"params": False}, in_axes=1, out_axes=1)
        carry = nn.OptimizedLSTMCell(6, parent=None).initialize_carry(
            jax.random.key(0), x[:, 0].shape)
        _, forward = scan(features=6, name="forward")(carry, x)
        _, backward = scan(features=6, name="backward")(carry, x[:, ::-1])
        return nn.Dense(2)(jnp.concatenate([forward, backward[:, ::-1]], -1))


def test_sst2_scan_listed_as_stock_with_its_reason():
    model, x = SST2Encoder(), jax.random.normal(jax.random.key(0), (3, 5, 4))
    params = model.init(jax.random.key(1), x)
    with jb.accelerate() as acc:
        y = jax.jit(model.apply)(params, x)
    _close(y, model.apply(params, x))
    cells = [c for c in acc.calls if c.layer == "OptimizedLSTMCell"]
    assert [c.path for c in cells] == ["forward", "backward"]
    assert all(not c.accelerated and "step by step" in c.reason for c in cells)
    assert [(c.path, c.accelerated, c.step_of) for c in acc.calls if c.layer == "Dense"] == [
        ("Dense_0", True, "")]


def test_bidirectional_runs_both_directions_fused():
    model = nn.Bidirectional(nn.RNN(nn.OptimizedLSTMCell(5)), nn.RNN(nn.LSTMCell(5)))
    x = jax.random.normal(jax.random.key(0), (2, 6, 3))
    params = model.init(jax.random.key(1), x)
    loss = lambda p: jnp.sum(model.apply(p, x) ** 2)  # noqa: E731
    with jb.accelerate() as acc:
        y = jax.jit(model.apply)(params, x)
        g = jax.jit(jax.grad(loss))(params)
        hlo = jax.jit(model.apply).lower(params, x).as_text()
    _close(y, model.apply(params, x))
    _close(g, jax.grad(loss)(params), 1e-4)
    assert [(c.layer, c.accelerated) for c in acc.calls] == [("RNN", True), ("RNN", True)]
    assert hlo.count("jb_lstm_fwd") == 2


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


def test_seq2seq_patterns_stock_with_per_step_layers_marked():
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
    assert [c.reason for c in rnns] == [
        "seq_lengths with return_carry (each sequence's own last carry)", "cell DecoderCell"]
    dense = [c for c in acc.calls if c.layer == "Dense"]
    assert len(dense) == 9 and all(c.accelerated and "RNN over" in c.step_of for c in dense)
    summary = acc.summary()
    assert "9 of them are layers inside stock recurrent scans" in summary
