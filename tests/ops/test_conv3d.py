"""jb.conv3d against stock lax.conv_general_dilated (NDHWC x DHWIO) and its jax.grad: dense,
grouped, depthwise, kernel- and input-dilated 3-D convolutions over many shapes (odd sizes,
size 1, empty batches, strides, paddings), fp32 and bf16, property-based, grad of grad, bad
input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_brgemm as jb
from stock_reference import conv_general_dilated as exact_conv

DN = ("NDHWC", "DHWIO", "NDHWC")


def stock(x, w, b, *, strides=1, padding="SAME", rhs_dilation=1, lhs_dilation=1, feature_group_count=1,
          dtype=jnp.float32):
    """The stock 3-D convolution as jb.conv3d computes it: products in `dtype`, fp32 sums."""
    three = lambda v: (v,) * 3 if isinstance(v, int) else tuple(v)  # noqa: E731
    padding = [(padding, padding)] * 3 if isinstance(padding, int) else padding
    y = exact_conv(
        x.astype(dtype), w.astype(dtype), three(strides), padding, lhs_dilation=three(lhs_dilation),
        rhs_dilation=three(rhs_dilation), feature_group_count=feature_group_count, dimension_numbers=DN,
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return (y + b).astype(dtype)


def close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=tol * (1 + np.abs(b).max(initial=0)), rtol=tol)


def check(x_shape, w_shape, dtype=jnp.float32, seed=0, **kw):
    """The output and the gradients in x, w and b against stock's; the forward is on the
    kernels (a jb_conv call in the program) whenever it has an output to reduce."""
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], x_shape)
    w = jax.random.normal(keys[1], w_shape) / np.sqrt(max(1, np.prod(w_shape[:-1])))
    b = 0.1 * jax.random.normal(keys[2], w_shape[-1:])
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-4
    ours = jax.jit(lambda x, w, b: jb.conv3d(x, w, b, dtype=dtype, **kw))
    y = ours(x, w, b)
    assert y.dtype == dtype
    close(y, stock(x, w, b, dtype=dtype, **kw), tol)
    if y.size and x.shape[0] and w_shape[3]:
        assert "custom_call @jb_conv_" in ours.lower(x, w, b).as_text()
    cot = jax.random.normal(keys[3], y.shape)

    def grads(f):
        return jax.grad(lambda x, w, b: jnp.sum(f(x, w, b).astype(jnp.float32) * cot), argnums=(0, 1, 2))(x, w, b)

    for g, want in zip(grads(ours), grads(lambda x, w, b: stock(x, w, b, dtype=dtype, **kw)), strict=True):
        close(g, want, tol)


# (x shape, w shape, keywords)
CASES = [
    ((2, 5, 6, 7, 4), (3, 3, 3, 4, 6), {}),
    ((1, 4, 5, 5, 3), (1, 1, 1, 3, 8), {}),                                      # pointwise
    ((2, 6, 7, 5, 4), (2, 3, 1, 2, 6), dict(strides=(2, 1, 2), feature_group_count=2,
                                            padding=[(1, 0), (1, 1), (0, 2)], rhs_dilation=(2, 1, 1))),
    ((1, 4, 5, 5, 6), (3, 3, 3, 1, 6), dict(strides=(1, 2, 1), padding="VALID", feature_group_count=6)),
    ((2, 3, 4, 4, 4), (3, 3, 3, 4, 3), dict(padding=[(2, 2)] * 3, lhs_dilation=2)),  # transposed
    ((2, 3, 4, 4, 4), (3, 2, 3, 4, 3), dict(strides=2, padding=[(1, 1), (2, 0), (1, 2)],
                                            lhs_dilation=(2, 1, 2))),             # dilated and strided
    ((1, 1, 1, 1, 2), (1, 1, 1, 2, 1), {}),                                      # all sizes 1
    ((3, 7, 3, 2, 5), (5, 1, 2, 5, 7), dict(padding=2, rhs_dilation=(2, 1, 1))),
    ((0, 3, 4, 4, 2), (2, 2, 2, 2, 3), {}),                                      # empty batch
    ((1, 2, 3, 3, 2), (3, 1, 1, 2, 2), dict(padding="VALID")),                   # no output depth
]


@pytest.mark.parametrize("x_shape,w_shape,kw", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_matches_lax(x_shape, w_shape, kw, dtype):
    check(x_shape, w_shape, dtype, **kw)


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.integers(1, 6), h=st.integers(1, 6), c=st.sampled_from([1, 2, 6]), kg=st.sampled_from([1, 3]),
       t=st.integers(1, 3), r=st.integers(1, 3), groups=st.sampled_from([1, 2]), sd=st.integers(1, 2),
       dd=st.integers(1, 2), ld=st.integers(1, 2), bf16=st.booleans())
def test_hypothesis_shapes(d, h, c, kg, t, r, groups, sd, dd, ld, bf16):
    c *= groups
    pads = [((t - 1) * dd, (t - 1) * dd - 1 + sd), (1, 0), (r - 1, r - 1)]  # explicit (lhs_dilation)
    check((2, d, h, 3, c), (t, r, 2, c // groups, kg * groups), jnp.bfloat16 if bf16 else jnp.float32,
          strides=(sd, 1, 1), padding=pads, rhs_dilation=(dd, 1, 1), lhs_dilation=(ld, 1, ld),
          feature_group_count=groups)


@pytest.mark.slow  # 13 s; the quick tier has the 2-D convolution's (test_conv.py)
def test_grad_of_grad():
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (2, 4, 5, 3, 2))
    w = 0.3 * jax.random.normal(keys[1], (2, 3, 2, 2, 3))
    b = 0.1 * jax.random.normal(keys[2], (3,))
    kw = dict(strides=(2, 1, 1), padding="SAME")

    def outer(conv):
        inner = jax.grad(lambda x, w, b: jnp.sum(jnp.sin(conv(x, w, b))), argnums=(0, 1, 2))
        return jax.grad(lambda x, w, b: sum(jnp.sum(jnp.cos(g)) for g in inner(x, w, b)), argnums=(0, 1, 2))

    got = jax.jit(outer(lambda x, w, b: jb.conv3d(x, w, b, **kw)))(x, w, b)
    for g, want in zip(got, outer(lambda x, w, b: stock(x, w, b, **kw))(x, w, b), strict=True):
        close(g, want, 2e-4)


@pytest.mark.parametrize("args,kw,error,match", [
    (((1, 4, 4, 4, 3), (3, 3, 3, 3, 2)), dict(feature_group_count=2), ValueError, "feature_group_count=2"),
    (((1, 4, 4, 4, 4), (3, 3, 3, 3, 2)), {}, ValueError, "expects C = 3"),
    (((1, 4, 4, 4), (3, 3, 3, 4, 2)), {}, ValueError, "x"),
    (((1, 4, 4, 4, 4), (3, 3, 4, 2)), {}, ValueError, "kernel"),
    (((1, 4, 4, 4, 4), (3, 3, 3, 4, 2)), dict(strides=(1, 1)), ValueError, "strides"),
    (((1, 4, 4, 4, 4), (3, 3, 3, 4, 2)), dict(rhs_dilation=(1, 0, 1)), ValueError, "rhs_dilation"),
    (((1, 4, 4, 4, 4), (3, 3, 3, 4, 2)), dict(rhs_dilation=-1), TypeError, "rhs_dilation"),
    (((1, 4, 4, 4, 4), (3, 3, 3, 4, 2)), dict(strides=1.5), TypeError, "strides"),
    (((1, 4, 4, 4, 4), (3, 3, 3, 4, 2)), dict(lhs_dilation=2), ValueError, "explicit pads"),
    (((1, 4, 4, 4, 4), (3, 3, 3, 4, 2)), dict(padding=[(1, 1)] * 2), ValueError, "padding"),
    (((1, 4, 4, 4, 4), (3, 3, 3, 4, 2)), dict(padding=-1), ValueError, "paddings must be >= 0"),
    (((1, 4, 4, 4, 4), (3, 3, 3, 4, 2)), dict(precision="float16"), ValueError, "precision"),
])
def test_bad_input_names_the_argument(args, kw, error, match):
    x, w = (jnp.ones(s) for s in args)
    with pytest.raises(error, match=match):
        jb.conv3d(x, w, **kw)


def test_kernel_larger_than_input_is_lax_s_empty_result():
    """A VALID window beyond the input has no output, as in lax (not an error)."""
    x, w = jnp.ones((1, 2, 4, 4, 2)), jnp.ones((3, 3, 3, 2, 2))
    assert jb.conv3d(x, w, padding="VALID").shape == (1, 0, 2, 2, 2)
