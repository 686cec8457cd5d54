"""Stock references and comparison helpers shared by the tests (a plain module, not a test
file: pytest puts this folder, conftest.py's, on sys.path)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, **kw):
    """lax.conv_general_dilated with its padding and input dilation done by lax.pad first:
    the same sums, and a gradient that is right. XLA CPU's float convolution reads outside its
    input where a low pad is negative (openxla/xla#48713), and the gradient of a convolution
    whose low pad exceeds the filter's reach is such a convolution: stock's dx then picks up
    the next image's pixels (jaxlib 0.10.2, float32 and bfloat16)."""
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    spatial, taps = dn.lhs_spec[2:], dn.rhs_spec[2:]
    ldil = tuple(lhs_dilation or (1,) * len(spatial))
    rdil = tuple(rhs_dilation or (1,) * len(spatial))
    if isinstance(padding, str):
        dilated = [(lhs.shape[d] - 1) * e + 1 for d, e in zip(spatial, ldil)]
        window = [(rhs.shape[d] - 1) * e + 1 for d, e in zip(taps, rdil)]
        padding = lax.padtype_to_pads(dilated, window, window_strides, padding)
    config = [(0, 0, 0)] * lhs.ndim
    for d, (lo, hi), e in zip(spatial, padding, ldil):
        config[d] = (lo, hi, e - 1)
    lhs = lax.pad(lhs, jnp.zeros((), lhs.dtype), config)
    return lax.conv_general_dilated(lhs, rhs, window_strides, "VALID", rhs_dilation=rdil,
                                    dimension_numbers=dimension_numbers, **kw)


def loss(f, *args, **kw):
    """A scalar with a different cotangent for every output element of f(*a, **kw)."""
    def fn(*a):
        y = f(*a, **kw).astype(jnp.float32)
        return jnp.sum(jnp.sin(y) * jnp.linspace(0.5, 1.5, y.size).reshape(y.shape))
    return fn


def assert_close(got, want, tol):
    """Equal within tol times the reference's largest magnitude (at least 1)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


def scan_lstm(x, wi, wh, b, c0, h0, time_major=False):
    """The reference: OptimizedLSTMCell's math as a lax.scan."""
    xs = x if time_major else jnp.swapaxes(x, 0, 1)

    def step(carry, xt):
        c, h = carry
        i, f, g, o = jnp.split(xt @ wi + h @ wh + b, 4, -1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h

    carry, y = jax.lax.scan(step, (c0, h0), xs)
    return carry, (y if time_major else jnp.swapaxes(y, 0, 1))
