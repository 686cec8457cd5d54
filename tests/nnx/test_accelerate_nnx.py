"""jax_brgemm.accelerate() over unmodified flax.nnx models: the stock outputs, gradients and
state, the layers on the kernels under jax.jit / nnx.jit / nnx.grad / nnx.vmap / nnx.scan,
the fallbacks reported with their reasons, and nothing changed in other threads."""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_brgemm as jb


class CNN(nnx.Module):  # the Flax NNX MNIST tutorial's model, smaller
    def __init__(self, *, rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(16 * 3 * 3, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


class RNNClassifier(nnx.Module):  # stacked LSTMs and a head, as people write them
    def __init__(self, cell, *, rngs):
        self.rnn1 = nnx.RNN(cell(7, 16, rngs=rngs))
        self.rnn2 = nnx.RNN(cell(16, 12, rngs=rngs))
        self.head = nnx.Linear(12, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(self.rnn2(self.rnn1(x))[:, -1])


def normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape)


def close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=tol, atol=tol)


def kernel_calls(model, x) -> int:
    graphdef, state = nnx.split(model)
    text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).as_text()
    return text.count("custom_call @jb_")  # a kernel pass is a primitive, lowered to its call


def loss(model, x):
    return jnp.sum(model(x) ** 2)


@pytest.mark.parametrize("make,shape,calls", [
    (lambda: CNN(rngs=nnx.Rngs(0)), (3, 14, 14, 1), 4),
    pytest.param(lambda: RNNClassifier(nnx.OptimizedLSTMCell, rngs=nnx.Rngs(0)), (3, 5, 7), 3,
                 marks=pytest.mark.slow),  # the quick tier runs it in test_nnx_modules.py
    (lambda: RNNClassifier(nnx.LSTMCell, rngs=nnx.Rngs(0)), (3, 5, 7), 3),
], ids=["cnn", "lstm", "lstm-cell"])
def test_same_outputs_gradients_and_state(make, shape, calls):
    model, x = make(), normal(1, shape)
    state = nnx.state(model)
    want_y, want_g = model(x), nnx.grad(loss)(model, x)
    with jb.accelerate() as acc:
        y = nnx.jit(lambda m, x: m(x))(model, x)
        g = nnx.jit(nnx.grad(loss))(model, x)
        value, g2 = nnx.value_and_grad(loss)(model, x)
        inside = kernel_calls(model, x)
    close(y, want_y)
    close(g, want_g, 1e-4)
    close(g2, want_g, 1e-4)
    close(value, loss(model, x), 1e-4)
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(state)
    assert inside >= calls and kernel_calls(model, x) == 0
    assert sum(c.accelerated for c in acc.calls) == calls == len(acc.calls), acc.summary()


def test_under_jax_jit_vmap_and_scan():
    layer = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = normal(1, (6, 2, 5))
    with jb.accelerate() as acc:
        y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
        yv = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(layer, x)

        @nnx.scan(in_axes=(None, nnx.Carry), out_axes=nnx.Carry, length=3)
        def repeat(m, h):  # the same layer applied three times, under nnx.scan
            return jnp.tanh(m(h) @ jnp.ones((4, 5)))

        ys = repeat(layer, x[0])
    close(y, layer(x))
    close(yv, layer(x))
    h = x[0]
    for _ in range(3):
        h = jnp.tanh(layer(h) @ jnp.ones((4, 5)))
    close(ys, h)
    assert acc.calls and all(c.accelerated for c in acc.calls)


def test_fallbacks_say_why_and_per_step_layers_say_so():
    x = normal(1, (2, 4, 6))
    half = nnx.Linear(6, 3, dtype=jnp.float16, rngs=nnx.Rngs(0))
    gru = nnx.RNN(nnx.GRUCell(6, 5, rngs=nnx.Rngs(0)))
    lstm = nnx.RNN(nnx.OptimizedLSTMCell(6, 5, rngs=nnx.Rngs(0)), return_carry=True)
    x2 = x[None]  # flax selects each sequence's carry along one batch dim only
    lengths = jnp.array([4, 2])
    with jb.accelerate(report=True) as acc:
        a, b = half(x), gru(x)
        c = lstm(x2, seq_lengths=lengths)
    np.testing.assert_array_equal(a, half(x))
    close(b, gru(x))
    close(c, lstm(x2, seq_lengths=lengths))
    by_layer = {(c.path, c.step_of != ""): c for c in acc.calls}
    assert by_layer[("nnx.Linear(6 -> 3)", False)].reason == "float16 computation"
    assert by_layer[("nnx.RNN(nnx.GRUCell(6 -> 5))", False)].reason == "cell GRUCell"
    assert (by_layer[("nnx.RNN(nnx.OptimizedLSTMCell(6 -> 5))", False)].reason
            == "seq_lengths with return_carry over 2 batch dims, not one")
    steps = [c for c in acc.calls if c.step_of]
    assert steps and all(c.accelerated and c.layer == "Linear" for c in steps)
    assert "per step" in acc.summary() and "once per time step" in acc.summary()


def test_a_cell_called_in_a_loop_is_listed():
    cell = nnx.LSTMCell(3, 4, rngs=nnx.Rngs(0))
    x = normal(1, (2, 5, 3))
    carry = cell.initialize_carry((2, 3), nnx.Rngs(0))
    with jb.accelerate() as acc:
        for t in range(2):
            carry, _ = cell(carry, x[:, t])
    (listed,) = [c for c in acc.calls if c.layer == "LSTMCell"]
    assert not listed.accelerated and "step by step" in listed.reason
    assert all(c.step_of for c in acc.calls if c.layer == "Linear")


def test_other_threads_are_not_affected():
    model, x = CNN(rngs=nnx.Rngs(0)), normal(1, (2, 14, 14, 1))
    seen = {}
    entered, done = threading.Event(), threading.Event()

    def other():
        entered.wait()
        seen["calls"] = kernel_calls(model, x)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with jb.accelerate() as acc:
        entered.set()
        done.wait()
        here = kernel_calls(model, x)
    thread.join()
    assert seen["calls"] == 0 and here >= 4
    assert len(acc.calls) == 4  # the other thread's calls were not recorded here


def test_report_warns_when_it_saw_nothing():
    model, x = CNN(rngs=nnx.Rngs(0)), normal(1, (2, 14, 14, 1))
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    with jb.accelerate() as first:
        run(state, x)
    assert first.calls
    # traced inside an equal context before: its program on the kernels runs from the cache
    with pytest.warns(UserWarning, match="from jax.jit's cache"):
        with jb.accelerate(report=True) as acc:
            run(state, x)
    assert acc.calls == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jb.accelerate(report=True):
            model(x)
