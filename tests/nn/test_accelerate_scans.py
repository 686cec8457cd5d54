"""jax_brgemm.accelerate() over the recurrent patterns of Flax's linen examples: nn.Bidirectional,
nn.scan over an LSTM cell or over a method calling one (sst2) and seq2seq's encoder
(seq_lengths with return_carry) fused, and the patterns that stay stock (a scan with per-step
parameters, a scanned method's body doing more than one cell step, a custom cell, seq_lengths
with return_carry over two batch dims) listed with their reasons, the layers inside them
marked as per-step work rather than counted as accelerated recurrent layers."""

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


class ScannedMethod(nn.Module):  # flax's sst2 SimpleLSTM: nn.scan over a method, fused
    @functools.partial(nn.scan, variable_broadcast="params", in_axes=1, out_axes=1,
                       split_rngs={"params": False})
    @nn.compact
    def __call__(self, carry, x):
        return nn.OptimizedLSTMCell(6)(carry, x)


def test_scan_over_a_method_calling_one_cell_fused():
    model, x = ScannedMethod(), jax.random.normal(jax.random.key(0), (3, 5, 4))
    carry = (jnp.zeros((3, 6)),) * 2
    params = model.init(jax.random.key(1), carry, x)
    with jb.accelerate() as acc:
        y = jax.jit(model.apply)(params, carry, x)
    _close(y, model.apply(params, carry, x))
    assert [(c.layer, c.accelerated) for c in acc.calls] == [
        ("nn.scan(ScannedMethod.__call__)", True)]


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


# --- flax's sst2 example's shape: nn.scan over a METHOD whose body calls one LSTM cell -------


def scan_over_method(**settings):
    """nn.scan, as flax's sst2 example applies it to a compact method, with ``settings``."""
    scan = dict(variable_broadcast="params", in_axes=1, out_axes=1, split_rngs={"params": False})
    scan.update(settings)
    return lambda body: functools.partial(nn.transforms.scan, **scan)(nn.compact(body))


class OneDirection(nn.Module):  # sst2's SimpleLSTM, written anew
    features: int

    @scan_over_method()
    def __call__(self, carry, x):
        return nn.OptimizedLSTMCell(self.features)(carry, x)

    def zero_carry(self, batch_shape):
        return nn.OptimizedLSTMCell(self.features, parent=None).initialize_carry(
            jax.random.key(0), batch_shape + (1,))


def reverse_within_lengths(x, lengths):
    """Each row's first ``length`` steps in reverse order, its padding left in place."""
    steps = jnp.arange(x.shape[1])[None]
    source = jnp.where(steps < lengths[:, None], lengths[:, None] - 1 - steps, steps)
    return jnp.take_along_axis(x, source[..., None], axis=1)


class TwoDirections(nn.Module):  # sst2's SimpleBiLSTM: the backward pass on flipped inputs
    features: int = 5

    def setup(self):
        self.forward_lstm = OneDirection(self.features)
        self.backward_lstm = OneDirection(self.features)

    def __call__(self, x, lengths):
        carry = self.forward_lstm.zero_carry(x.shape[:1])
        _, forward = self.forward_lstm(carry, x)
        _, backward = self.backward_lstm(carry, reverse_within_lengths(x, lengths))
        return jnp.concatenate([forward, reverse_within_lengths(backward, lengths)], -1)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 5e-2)])
def test_sst2_method_form_bidirectional_fused_forward_and_backward(dtype, tol):
    model = TwoDirections()
    x = jax.random.normal(jax.random.key(0), (3, 7, 4)).astype(dtype)
    lengths = jnp.array([7, 2, 5])
    params = model.init(jax.random.key(1), x, lengths)

    def loss(p, x):
        return jnp.sum(jnp.sin(model.apply(p, x, lengths).astype(jnp.float32)))

    grad = jax.grad(loss, argnums=(0, 1))
    with jb.accelerate() as acc:
        y = jax.jit(model.apply)(params, x, lengths)
        grads = jax.jit(grad)(params, x)
        hlo = jax.jit(grad).lower(params, x).as_text()
    want = model.apply(params, x, lengths)
    assert y.dtype == want.dtype
    _close(y, want, tol)
    _close(grads, grad(params, x), 2 * tol)
    assert hlo.count("jb_lstm_fwd") == 2 and hlo.count("jb_lstm_bptt") == 2
    assert [(c.path, c.layer, c.accelerated, c.reason) for c in acc.calls] == [
        ("forward_lstm", "nn.scan(OneDirection.__call__)", True, ""),
        ("backward_lstm", "nn.scan(OneDirection.__call__)", True, "")]
    assert "2 of 2 layer calls on the kernels" in acc.summary()


def test_both_directions_share_one_probe(monkeypatch):
    from jax_brgemm.accelerate import scans

    probes = []
    probe = scans._probe
    monkeypatch.setattr(scans, "_verdicts", {})
    monkeypatch.setattr(scans, "_probe", lambda *a: probes.append(a) or probe(*a))
    model, x, lengths = TwoDirections(features=3), jnp.ones((2, 4, 3)), jnp.array([4, 1])
    params = model.init(jax.random.key(0), x, lengths)
    with jb.accelerate() as acc:
        jax.jit(model.apply).lower(params, x, lengths)
        jax.jit(model.apply).lower(params, x, lengths)  # traced again: the verdict is kept
    assert len(probes) == 1 and all(c.accelerated for c in acc.calls)


def method_scan_model(body, **settings):
    class Scanned(nn.Module):
        __call__ = scan_over_method(**settings)(body)

    return Scanned()


def one_cell(self, carry, x):
    return nn.LSTMCell(5, name="step")(carry, x)


def one_cell_result_repacked(self, carry, x):
    (c, h), y = nn.OptimizedLSTMCell(5)(carry, x)
    return (c, h), y  # new tuples of the very arrays the cell returned


@pytest.mark.parametrize("body", [one_cell, one_cell_result_repacked])
@pytest.mark.parametrize("settings", [dict(reverse=True), dict(in_axes=0, out_axes=0),
                                      dict(in_axes=0, out_axes=1, reverse=True)])
def test_method_scan_settings_fused_as_stock_computes_them(body, settings):
    model = method_scan_model(body, **settings)
    x = jax.random.normal(jax.random.key(0), (4, 3, 2))
    batch = x.shape[1] if settings.get("in_axes") == 0 else x.shape[0]
    carry = tuple(jax.random.normal(jax.random.key(k), (batch, 5)) for k in (1, 2))
    params = model.init(jax.random.key(3), carry, x)
    loss = lambda p: jnp.sum(jnp.sin(model.apply(p, carry, x)[1]))  # noqa: E731
    with jb.accelerate() as acc:
        got = jax.jit(model.apply)(params, carry, x)
        grads = jax.jit(jax.grad(loss))(params)
    _close(got, model.apply(params, carry, x))
    _close(grads, jax.grad(loss)(params), 1e-4)
    assert [(c.layer, c.accelerated) for c in acc.calls] == [("nn.scan(Scanned.__call__)", True)]


def x_changed(self, carry, x):
    return nn.OptimizedLSTMCell(5)(carry, 2 * x)


def carry_swapped(self, carry, x):
    return nn.OptimizedLSTMCell(5)(carry[::-1], x)


def output_changed(self, carry, x):
    carry, y = nn.OptimizedLSTMCell(5)(carry, x)
    return carry, jnp.tanh(y)


def two_cells(self, carry, x):
    carry, y = nn.OptimizedLSTMCell(5)(carry, x)
    return nn.LSTMCell(5)(carry, y)


def dense_besides(self, carry, x):
    nn.Dense(3)(x)  # its result unused: still more than one cell call
    return nn.OptimizedLSTMCell(5)(carry, x)


def gru(self, carry, x):
    h, y = nn.GRUCell(5)(carry[0], x)
    return (h, carry[1]), y


@pytest.mark.parametrize("body, reason", [
    (x_changed, "gives OptimizedLSTMCell other arguments than its own (carry, x)"),
    (carry_swapped, "gives OptimizedLSTMCell other arguments"),
    (output_changed, "returns other than OptimizedLSTMCell's result"),
    (two_cells, "makes 2 module calls (OptimizedLSTMCell.__call__, LSTMCell.__call__)"),
    (dense_besides, "makes 2 module calls (Dense.__call__, OptimizedLSTMCell.__call__)"),
    (gru, "calls GRUCell.__call__, not OptimizedLSTMCell / LSTMCell"),
])
def test_method_scan_bodies_doing_more_stay_stock_with_their_reason(body, reason):
    model = method_scan_model(body)
    x = jax.random.normal(jax.random.key(0), (2, 4, 5))
    carry = tuple(jax.random.normal(jax.random.key(k), (2, 5)) for k in (1, 2))
    params = model.init(jax.random.key(3), carry, x)
    with jb.accelerate() as acc:
        got = jax.jit(model.apply)(params, carry, x)
        hlo = jax.jit(model.apply).lower(params, carry, x).as_text()
    _close(got, model.apply(params, carry, x))
    assert "jb_lstm_fwd" not in hlo
    scans = [c for c in acc.calls if c.layer.startswith("nn.scan")]
    assert [(c.layer, c.accelerated) for c in scans] == [("nn.scan(Scanned.__call__)", False)]
    assert reason in scans[0].reason
    # the cells run step by step inside the listed stock scan, not as records of their own;
    # a Dense inside runs on the kernels once per step and says so
    others = [c for c in acc.calls if c not in scans]
    assert all(c.layer == "Dense" and c.step_of.startswith("<top> [nn.scan(Scanned.__call__)]")
               for c in others)


def test_method_scan_stock_while_a_collection_is_mutable():
    model = method_scan_model(one_cell)
    x, carry = jnp.ones((2, 3, 4)), (jnp.zeros((2, 5)),) * 2
    params = model.init(jax.random.key(0), carry, x)
    with jb.accelerate() as acc:
        got, _ = model.apply(params, carry, x, mutable=["intermediates"])
    _close(got, model.apply(params, carry, x))
    assert not acc.calls[0].accelerated and "mutable" in acc.calls[0].reason


@pytest.mark.slow  # fetches flax's source distribution once (tests/nnx/flax_sources.py)
def test_flax_sst2_text_classifier_runs_both_lstms_fused():
    import importlib.util
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "nnx"))
    from flax_sources import flax_source_tree

    source = flax_source_tree() / "examples" / "sst2" / "models.py"
    spec = importlib.util.spec_from_file_location("flax_sst2_models", source)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    model = models.TextClassifier(embedding_size=8, hidden_size=6, vocab_size=20, output_size=3,
                                  dropout_rate=0.0, word_dropout_rate=0.0, deterministic=True)
    tokens = jax.random.randint(jax.random.key(0), (4, 9), 2, 20)
    lengths = jnp.array([9, 3, 6, 1])
    params = model.init(jax.random.key(1), tokens, lengths)
    loss = lambda p: jnp.sum(jnp.sin(model.apply(p, tokens, lengths)))  # noqa: E731
    with jb.accelerate() as acc:
        logits = jax.jit(model.apply)(params, tokens, lengths)
        grads = jax.jit(jax.grad(loss))(params)
        hlo = jax.jit(jax.grad(loss)).lower(params).as_text()
    _close(logits, model.apply(params, tokens, lengths), 1e-4)
    _close(grads, jax.grad(loss)(params), 1e-4)
    assert hlo.count("jb_lstm_fwd") == 2 and hlo.count("jb_lstm_bptt") == 2
    scans = [(c.path, c.accelerated) for c in acc.calls if c.layer == "nn.scan(SimpleLSTM.__call__)"]
    assert scans == [("encoder/forward_lstm", True), ("encoder/backward_lstm", True)]
