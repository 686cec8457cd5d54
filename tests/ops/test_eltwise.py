"""jb.ops.eltwise.gelu against jax.nn.gelu: the value (XLA's own), the derivative on the
kernels in both modes and to second order, odd shapes, scalars, sizes of 0, bf16, vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_brgemm.ops.eltwise import gelu
from stock_reference import assert_close

F32, BF16 = jnp.float32, jnp.bfloat16


def sample(shape, dtype=F32, seed=0):
    return jnp.asarray(3 * np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (5, 33), (2, 3, 130), (1024, 17)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_value_and_gradient(shape, dtype):
    x = sample(shape, dtype)
    assert_close(jax.jit(gelu)(x), jax.nn.gelu(x), 1e-2 if dtype == BF16 else 1e-6)  # XLA fuses the same formula
    w = sample(shape, F32, seed=1)
    grad = lambda f: jax.jit(jax.grad(lambda x: jnp.sum(f(x).astype(w.dtype) * w)))  # noqa: E731
    got = grad(gelu)(x)
    with jax.enable_x64(True):  # the derivative at the (rounded) input, in float64
        want = np.asarray(grad(jax.nn.gelu)(jnp.asarray(x, jnp.float64)), np.float64)
    assert got.dtype == dtype
    assert_close(got, want, 1e-2 if dtype == BF16 else 1e-6)
    # relative accuracy in the negative tail too, where the derivative is small (below 1e-8
    # its two terms cancel: absolute accuracy there)
    tail = (np.asarray(x, np.float64) < -3) & (np.abs(want) > 1e-8)
    np.testing.assert_allclose(np.asarray(got, np.float64)[tail], want[tail], rtol=1e-2 if dtype == BF16 else 1e-4,
                               atol=1e-30)
    if x.ndim:
        assert "jb_fc_act_grad" in grad(gelu).lower(x).as_text()


def test_forward_mode_second_order_and_vmap():
    x, t = sample((4, 9)), sample((4, 9), seed=2)
    got = jax.jit(lambda x, t: jax.jvp(gelu, (x,), (t,)))(x, t)
    for g, w in zip(got, jax.jvp(jax.nn.gelu, (x,), (t,))):
        assert_close(g, w, 1e-6)
    h = lambda f: jax.hessian(lambda v: jnp.sum(f(v) ** 2))  # noqa: E731
    assert_close(jax.jit(h(gelu))(x[0]), h(jax.nn.gelu)(x[0]), 1e-5)
    assert_close(jax.jit(jax.vmap(jax.grad(lambda v: jnp.sum(gelu(v)))))(x),
                 jax.vmap(jax.grad(lambda v: jnp.sum(jax.nn.gelu(v))))(x), 1e-6)


def test_other_dtypes_and_empty_arrays_are_stock():
    for x in (sample((3, 4), jnp.float16), jnp.zeros((0, 5), F32)):
        np.testing.assert_array_equal(gelu(x), jax.nn.gelu(x))
        assert "jb_fc_act_grad" not in jax.jit(jax.grad(lambda v: jnp.sum(gelu(v)))).lower(x).as_text()
