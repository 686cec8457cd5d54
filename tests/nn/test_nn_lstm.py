"""jb.nn.LSTM and a stock nn.RNN inside accelerate() as drop-ins where the stock module has
edge cases: empty batches and sequences, second-order reverse mode, dtypes the kernels do
not take, each sequence's own last carry (seq_lengths with return_carry)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb


def stock(features, cell=nn.OptimizedLSTMCell, dtype=None, **kw):
    return nn.RNN(cell(features, dtype=dtype), **kw)


def close(a, b, tol):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for u, v in zip(la, lb, strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype, (u.shape, v.shape, u.dtype, v.dtype)
        np.testing.assert_allclose(np.asarray(u, np.float32), np.asarray(v, np.float32), rtol=tol, atol=tol)


def params_with_bias(features, c, seed=0):
    params = stock(features).init(jax.random.key(seed), jnp.ones((1, 2, c)))
    return jax.tree_util.tree_map_with_path(lambda p, v: v + 0.1 if p[-1].key == "bias" else v, params)


def accelerated(module):
    def apply(*args, **kw):
        with jb.accelerate():
            return module.apply(*args, **kw)
    return apply


@pytest.mark.parametrize("shape,time_major", [((0, 5, 3), False), ((2, 0, 3), False), ((0, 0, 3), False),
                                              ((0, 2, 3), True), ((4, 0, 3), True), ((2, 0, 3, 3), False)])
@pytest.mark.parametrize("return_carry", [False, True])
def test_empty_batch_or_sequence_gives_the_stock_result(shape, time_major, return_carry):
    params = params_with_bias(4, 3)
    x = jnp.ones(shape)
    kw = dict(time_major=time_major, return_carry=return_carry)
    want = stock(4, **kw).apply(params, x)
    close(jb.nn.LSTM(4, **kw).apply(params, x), want, 0)
    for cell in (nn.OptimizedLSTMCell, nn.LSTMCell):
        close(accelerated(stock(4, cell, **kw))(params, x), want, 0)


def test_empty_sequence_passes_the_initial_carry_and_its_gradient():
    params = params_with_bias(4, 3)
    x = jnp.ones((2, 0, 3))
    carry = (jnp.full((2, 4), 0.5), jnp.full((2, 4), -0.25))

    def loss(apply):
        def f(carry):
            (c, h), _ = apply(params, x, initial_carry=carry)
            return jnp.sum(c * c) + jnp.sum(3 * h)
        return jax.value_and_grad(f)(carry)

    want = loss(stock(4, return_carry=True).apply)
    close(loss(jb.nn.LSTM(4, return_carry=True).apply), want, 0)
    close(loss(accelerated(stock(4, return_carry=True))), want, 0)


def gradient_penalty(apply, x, carry):
    """A loss with the input gradient inside, differentiated again w.r.t. the parameters
    and the initial carry (grad of grad)."""
    def inner(params, x, carry):
        (c, h), y = apply(params, x, initial_carry=carry)
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(c * h) + 0.5 * jnp.sum(c ** 2)

    def outer(params, carry):
        dx, dcarry = jax.grad(inner, argnums=(1, 2))(params, x, carry)
        return jnp.sum(dx ** 2) + jnp.sum(dcarry[0] * dcarry[1])

    return jax.grad(outer, argnums=(0, 1))


@pytest.mark.parametrize("time_major", [pytest.param(False, marks=pytest.mark.slow), True])
def test_grad_of_grad_matches_stock(time_major):
    n, t, c, k = 3, 4, 5, 6
    params = params_with_bias(k, c, seed=1)
    shape = (t, n, c) if time_major else (n, t, c)
    x = jax.random.normal(jax.random.key(2), shape)
    carry = tuple(0.5 * jax.random.normal(jax.random.key(3 + i), (n, k)) for i in range(2))
    kw = dict(time_major=time_major, return_carry=True)
    want = gradient_penalty(stock(k, **kw).apply, x, carry)(params, carry)
    close(jax.jit(gradient_penalty(jb.nn.LSTM(k, **kw).apply, x, carry))(params, carry), want, 1e-4)
    for cell in (nn.OptimizedLSTMCell, nn.LSTMCell):
        got = gradient_penalty(accelerated(stock(k, cell, **kw)), x, carry)(params, carry)
        close(got, want, 1e-4)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_dtypes_the_kernels_do_not_take_compute_as_stock(dtype):
    # float16 computes as the stock module (README: configurations the kernels do not take
    # compute exactly as the stock module does); float32 is the control.
    params = params_with_bias(4, 3)
    x = jax.random.normal(jax.random.key(0), (2, 5, 3))
    want = stock(4, dtype=dtype, return_carry=True).apply(params, x)
    got = jb.nn.LSTM(4, dtype=dtype, return_carry=True).apply(params, x)
    close(got, want, 2e-3 if dtype == jnp.float16 else 2e-5)


def test_numpy_float64_inputs_are_canonicalized():
    params = params_with_bias(4, 3)
    x = np.random.default_rng(0).normal(size=(2, 5, 3))  # float64, NumPy's default
    want = stock(4, return_carry=True).apply(params, x)
    close(jb.nn.LSTM(4, return_carry=True).apply(params, x), want, 2e-5)
    close(jb.nn.LSTM(4, return_carry=True).apply(params, x.astype(np.float32)), want, 2e-5)


def kernel_calls(fn, *args):
    hlo = jax.jit(fn).lower(*args).as_text()
    return hlo.count("jb_lstm_fwd"), hlo.count("jb_lstm_bptt")


@pytest.mark.slow  # 33 s a case; the quick tier has seq_lengths in tests/ops/test_lstm.py and nnx
@pytest.mark.parametrize("kw", [dict(), dict(time_major=True), dict(reverse=True),
                                dict(reverse=True, keep_order=True)])
def test_seq_lengths_return_carry_matches_stock_on_the_kernels(kw):
    # lengths 0 and past T: the stock module's reading (the last step's carry, no gradient)
    n, t, c, k = 5, 6, 3, 4
    params = params_with_bias(k, c, seed=2)
    x = jax.random.normal(jax.random.key(4), (t, n, c) if kw.get("time_major") else (n, t, c))
    carry = tuple(0.5 * jax.random.normal(jax.random.key(5 + i), (n, k)) for i in range(2))
    lengths = jnp.array([6, 1, 0, 3, 8])
    mods = [jb.nn.LSTM(k, return_carry=True, **kw).apply]
    mods += [accelerated(stock(k, cell, return_carry=True, **kw))
             for cell in (nn.OptimizedLSTMCell, nn.LSTMCell)]
    stock_apply = stock(k, return_carry=True, **kw).apply

    def loss(apply):
        def f(params, x, carry):
            (c_, h_), y = apply(params, x, initial_carry=carry, seq_lengths=lengths)
            return jnp.sum(jnp.cos(c_) * h_) + jnp.sum(y * jnp.sin(y))
        return jax.grad(f, argnums=(0, 1, 2))

    want = stock_apply(params, x, initial_carry=carry, seq_lengths=lengths)
    want_grads = loss(stock_apply)(params, x, carry)
    for apply in mods:
        close(jax.jit(apply)(params, x, initial_carry=carry, seq_lengths=lengths), want, 2e-5)
        close(jax.jit(loss(apply))(params, x, carry), want_grads, 1e-4)
        assert kernel_calls(loss(apply), params, x, carry) == (1, 1)
    # grad of grad through the selected carry
    pick = dict(seq_lengths=lengths)
    want = gradient_penalty(lambda *a, **c: stock_apply(*a, **c, **pick), x, carry)(params, carry)
    for apply in mods:
        got = gradient_penalty(lambda *a, **c: apply(*a, **c, **pick), x, carry)(params, carry)
        close(got, want, 2e-4)


def test_seq_lengths_return_carry_bf16_and_two_batch_dims():
    params = params_with_bias(4, 3)
    x = jax.random.normal(jax.random.key(0), (3, 5, 3))
    lengths = jnp.array([5, 2, 1])
    got = jb.nn.LSTM(4, dtype=jnp.bfloat16, return_carry=True).apply(params, x, seq_lengths=lengths)
    want = stock(4, dtype=jnp.bfloat16, return_carry=True).apply(params, x, seq_lengths=lengths)
    close(got, want, 5e-2)  # the same dtypes too
    # two batch dims: stock Flax selects along the first only; both run its computation
    x2 = jax.random.normal(jax.random.key(1), (2, 2, 5, 3))
    want = stock(4, return_carry=True).apply(params, x2, seq_lengths=jnp.array([5, 2]))
    close(jb.nn.LSTM(4, return_carry=True).apply(params, x2, seq_lengths=jnp.array([5, 2])), want, 0)


def test_seq_lengths_return_carry_bad_input():
    params = params_with_bias(4, 3)
    x = jnp.ones((3, 5, 3))
    layer = jb.nn.LSTM(4, return_carry=True)
    with pytest.raises(TypeError, match="jb.nn.LSTM: seq_lengths must be an integer array, got float32"):
        layer.apply(params, x, seq_lengths=jnp.array([1.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match="jb.nn.LSTM: seq_lengths must be an integer array, got list"):
        layer.apply(params, x, seq_lengths=[1, 2, 3])
    with pytest.raises(ValueError, match=r"jb.nn.LSTM: seq_lengths must have shape \(batch,\) = \(3,\)"):
        layer.apply(params, x, seq_lengths=jnp.array([1, 2]))
    with pytest.raises(ValueError, match="at least one time step"):
        layer.apply(params, x[:, :0], seq_lengths=jnp.array([1, 2, 3]))
    # without return_carry seq_lengths only flips, as stock
    want = stock(4, reverse=True).apply(params, x, seq_lengths=jnp.array([1, 2, 3]))
    close(jb.nn.LSTM(4, reverse=True).apply(params, x, seq_lengths=jnp.array([1, 2, 3])), want, 2e-5)
