"""Stock references and comparison helpers shared by the op tests (a plain module, not a
test file: pytest puts this folder on sys.path)."""

import jax
import jax.numpy as jnp
import numpy as np


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
