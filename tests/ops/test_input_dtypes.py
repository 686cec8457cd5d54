"""Input dtypes as JAX canonicalizes them: NumPy float64 arrays (NumPy's default) are taken
as float32 unless jax_enable_x64 is on, as jnp.dot and the stock modules take them; with
x64 on, float64 computes in float64 as the stock computation does. Dtypes the kernels and
the ops do not take are a TypeError naming the argument."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb
from stock_reference import scan_lstm

RNG = np.random.default_rng(0)


def f64(*shape):
    return RNG.standard_normal(shape)  # float64


def conv_stock(x, k, b, strides, padding, act):
    y = jax.lax.conv_general_dilated(x, k, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return act(y + b)


CASES = {
    "dense": (lambda x, k, b: jb.dense(x, k, b, activation="tanh"),
              lambda x, k, b: jnp.tanh(jnp.dot(x, k) + b), lambda: (f64(5, 3), f64(3, 4), f64(4))),
    "brgemm": (lambda a, b, c: jb.brgemm(a, b, c), lambda a, b, c: jnp.einsum("bmk,bkn->mn", a, b) + c,
               lambda: (f64(2, 3, 4), f64(2, 4, 5), f64(3, 5))),
    "conv2d": (lambda x, k, b: jb.conv2d(x, k, b, strides=2, padding="SAME", activation="relu"),
               lambda x, k, b: conv_stock(x, k, b, (2, 2), "SAME", jax.nn.relu),
               lambda: (f64(2, 5, 6, 3), f64(3, 3, 3, 4), f64(4))),
    "lstm": (lambda x, wi, wh, b, c0, h0: jb.lstm(x, wi, wh, b, initial_carry=(c0, h0)), scan_lstm,
             lambda: (f64(2, 3, 4), 0.5 * f64(4, 8), 0.5 * f64(2, 8), f64(8), f64(2, 2), f64(2, 2))),
}


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


@pytest.mark.parametrize("name", sorted(CASES))
def test_numpy_float64_is_float32_without_x64(name):
    ours, stock, make = CASES[name]
    args = make()
    want = stock(*(jnp.asarray(a) for a in args))  # jnp canonicalizes to float32
    got = ours(*args)
    for a, e in zip(leaves(got), leaves(want), strict=True):
        assert a.dtype == jnp.float32 and e.dtype == jnp.float32 and a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-5)
    grads = jax.grad(lambda *a: sum(jnp.sum(v) for v in leaves(ours(*a))), argnums=range(len(args)))(*args)
    assert all(g.dtype == jnp.float32 for g in grads)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_with_x64_computes_as_stock_in_float64(name):
    ours, stock, make = CASES[name]
    args = make()
    with jax.enable_x64(True):
        want = stock(*args)
        got = ours(*args)
        for a, e in zip(leaves(got), leaves(want), strict=True):
            assert a.dtype == jnp.float64 == e.dtype and a.shape == e.shape
            np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12)

        def total(fn):
            return jax.grad(lambda *a: sum(jnp.sum(jnp.sin(v)) for v in leaves(fn(*a))), argnums=range(len(args)))
        for a, e in zip(total(ours)(*args), total(stock)(*args), strict=True):
            assert a.dtype == jnp.float64
            np.testing.assert_allclose(a, e, rtol=1e-10, atol=1e-10)


def test_x64_float32_inputs_still_run_on_the_kernels():
    x, k = np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)
    with jax.enable_x64(True):
        hlo = jax.jit(jb.dense).lower(x, k).as_text()
        assert "jb_fc_fwd" in hlo and jb.dense(x, k).dtype == jnp.float32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["dense", "conv2d", "lstm"])
def test_x64_float64_parameters_of_a_narrower_computation(name, dtype):
    # float32 inputs, float64 parameters and dtype= float32 / bfloat16: the parameters are
    # cast for the kernels (which take only float32 and bfloat16) as stock casts them.
    ours, stock, make = CASES[name]
    args = make()
    with jax.enable_x64(True):
        args = (jnp.asarray(args[0], jnp.float32),) + args[1:]
        call = {"dense": lambda x, k, b: jb.dense(x, k, b, activation="tanh", dtype=dtype),
                "conv2d": lambda x, k, b: jb.conv2d(x, k, b, strides=2, padding="SAME", activation="relu",
                                                    dtype=dtype),
                "lstm": lambda x, wi, wh, b, c0, h0: jb.lstm(x, wi, wh, b, initial_carry=(c0, h0), dtype=dtype)}[name]
        assert "jb_" in jax.jit(call).lower(*args).as_text()
        want = stock(*(jnp.asarray(a).astype(dtype) for a in args))
        tol = 2e-5 if dtype == "float32" else 5e-2
        for a, e in zip(leaves(call(*args)), leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("module,shape", [(nn.Dense(4), (2, 3)), (nn.Conv(4, (3, 3)), (1, 5, 5, 3))])
def test_modules_take_numpy_float64(module, shape):
    twin = {nn.Dense: jb.nn.Dense, nn.Conv: jb.nn.Conv}[type(module)]
    ours = twin(4) if twin is jb.nn.Dense else twin(4, (3, 3))
    x = f64(*shape)
    params = module.init(jax.random.key(0), x)
    want = module.apply(params, x)
    np.testing.assert_allclose(ours.apply(params, x), want, rtol=2e-5, atol=2e-5)
    with jb.accelerate():
        np.testing.assert_allclose(module.apply(params, x), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64, np.bool_, np.complex64])
def test_other_dtypes_are_a_type_error_naming_the_argument(dtype):
    x = np.ones((4, 3), dtype)
    with pytest.raises(TypeError, match="jb.dense: x must be float32 or bfloat16"):
        jb.dense(x, np.ones((3, 5), np.float32))
    with pytest.raises(TypeError, match="jb.brgemm: b must be float32 or bfloat16"):
        jb.brgemm(np.ones((1, 2, 4), np.float32), x[None])
