"""jb.ops.dense.attend (x @ embedding.T, a tied embedding's logits) against XLA: values and
gradients over odd shapes, leading dims, sizes of 0 and 1, bf16 and mixed dtypes, vmap,
forward mode and second order; the program reads the table in place; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_brgemm.ops.dense import attend
from stock_reference import assert_close, loss

F32, BF16 = jnp.float32, jnp.bfloat16


def data(lead, v, c, dtype=F32, table_dtype=None, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(lead + (c,)), dtype)
    return x, jnp.asarray(rng.standard_normal((v, c)), table_dtype or dtype)


def stock(x, embedding, dtype=None):
    dtype = dtype or jnp.promote_types(x.dtype, embedding.dtype)
    return jnp.matmul(x.astype(dtype), embedding.astype(dtype).T, preferred_element_type=F32).astype(dtype)


def check(x, embedding, tol=None):
    bf16 = BF16 in (x.dtype, embedding.dtype)
    tol = tol or (2e-2 if bf16 else 2e-5)
    both = lambda f: jax.jit(lambda x, e: (f(x, e), jax.grad(loss(f), (0, 1))(x, e)))  # noqa: E731
    (y, g), (want, r) = both(attend)(x, embedding), both(stock)(x, embedding)
    assert y.shape == want.shape and y.dtype == want.dtype
    assert_close(y, want, tol)
    for gi, ri, a in zip(g, r, (x, embedding)):
        assert gi.dtype == a.dtype and gi.shape == a.shape
        assert_close(gi, ri, 5 * tol)


@pytest.mark.parametrize("lead, v, c", [((7,), 13, 5), ((2, 9), 101, 24), ((1,), 1, 1), ((3, 1, 4), 37, 33),
                                        ((64,), 1000, 64), ((5,), 17, 130)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_shapes(lead, v, c, dtype):
    check(*data(lead, v, c, dtype))


def test_mixed_dtypes():
    """A bfloat16 query against a float32 table computes in float32 (promotion, as XLA),
    and the table's gradient stays float32."""
    check(*data((6, 5), 41, 16, BF16, F32))
    x, e = data((6,), 41, 16, F32, BF16)
    assert_close(attend(x, e, dtype=BF16), stock(x, e, BF16), 2e-2)


def test_zero_sizes():
    for lead, v, c in [((0,), 5, 3), ((4,), 0, 3), ((4,), 5, 0)]:
        x, e = data(lead, v, c)
        np.testing.assert_array_equal(attend(x, e), stock(x, e))


def test_the_table_is_read_in_place():
    """Every direction is one FC pass on the table as stored: no transposed copy, no XLA dot."""
    x, e = data((8, 16), 300, 32)
    text = jax.jit(jax.grad(loss(attend), (0, 1))).lower(x, e).as_text()
    assert all(t in text for t in ("jb_fc_bwd", "jb_fc_fwd", "jb_fc_upd"))
    assert "dot_general" not in text and "transpose" not in text


def test_vmap_forward_mode_and_second_order():
    x, e = data((3, 5), 29, 12)
    tx, te = data((3, 5), 29, 12, seed=1)
    got = jax.jit(lambda *a: jax.jvp(attend, a, (tx, te)))(x, e)
    want = jax.jvp(stock, (x, e), (tx, te))
    for g, w in zip(got, want):
        assert_close(g, w, 2e-5)
    assert_close(jax.jit(jax.vmap(attend, in_axes=(0, None)))(x, e), jax.vmap(stock, in_axes=(0, None))(x, e), 2e-5)

    def twice(f):
        inner = jax.grad(loss(f), (0, 1))
        return jax.grad(lambda x, e: sum(jnp.sum(jnp.cos(g)) for g in inner(x, e)), (0, 1))

    for g, w in zip(jax.jit(twice(attend))(x, e), twice(stock)(x, e)):
        assert_close(g, w, 1e-4)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(n=st.integers(1, 40), v=st.integers(1, 90), c=st.integers(1, 70), bf16=st.booleans())
def test_hypothesis_shapes(n, v, c, bf16):
    check(*data((n,), v, c, BF16 if bf16 else F32, seed=n + v))


def test_bad_input():
    x, e = data((4,), 9, 6)
    with pytest.raises(ValueError, match=r"jb.attend: x \(4, 6\) has 6 features but embedding \(9, 5\)"):
        attend(x, e[:, :5])
    with pytest.raises(ValueError, match="jb.attend: embedding must be"):
        attend(x, e[None])
    with pytest.raises(TypeError, match="jb.attend: x must be"):
        attend(x.astype(jnp.int32), e)
