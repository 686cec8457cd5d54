"""Property-based tests of jb.dense, jb.conv2d, jb.brgemm and jb.lstm against the stock
computation (jnp / lax, in the documented dtype semantics): random shapes (zeros
included), argument dtypes (float32, bfloat16, NumPy float64, float16, int32; x64 on or
off), strides, paddings, activations, biases, time_major and carries. Each call either
equals stock within a tolerance (values and gradients) or is refused with a ValueError /
TypeError naming the argument, where stock refuses too or where the op documents a limit
(float32 / bfloat16 operands, paddings >= 0, one dtype for brgemm's a and b)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import jax_brgemm as jb
from fuzz_support import (KERNEL_DTYPES, OP_DTYPES, REF_ACT, accumulation, activations, assert_close,
                          canonical, dtypes, expect_refusal, first_bad, kernel_friendly, make, mostly, profile,
                          promoted, sizes, stock_outcome, tolerance, weighed_sum, weights, x64_modes)

REFUSALS = (ValueError, TypeError)
requested_dtypes = mostly([None, None, "float32", "bfloat16"], "float16", times=2)


def compute_dtype(requested, *arrays):
    return np.dtype(jax.dtypes.canonicalize_dtype(requested)) if requested else promoted(*arrays)


def check_grads(ours, stock, args, rng, tol):
    """Gradients w.r.t. every argument of a loss weighing every output, ours vs stock."""
    w = weights(rng, jax.eval_shape(stock, *args))
    grad = lambda f: jax.grad(lambda *a: weighed_sum(f(*a), w), argnums=range(len(args)))  # noqa: E731
    assert_close(grad(ours)(*args), grad(stock)(*args), tol)


def all_float32(*arrays):
    return all(canonical(a) in ("float32", "float64") for a in arrays if a is not None)


# --- dense --------------------------------------------------------------------------------


@profile(15)
@given(st.data())
def test_dense(data):
    d = data.draw
    lead = tuple(d(st.lists(sizes(3), max_size=2)))
    c, k = d(sizes(9)), d(sizes(9))
    x_dtype, k_dtype, b_dtype = d(dtypes), d(kernel_friendly), d(kernel_friendly)
    use_bias, act, requested = d(st.booleans()), d(activations), d(requested_dtypes)
    wrong = d(mostly([None], "kernel", "bias", times=16))
    use_jit, x64, seed = d(st.booleans()), d(x64_modes), d(st.integers(0, 999))
    rng = np.random.default_rng(seed)
    with jax.enable_x64(x64):
        x = make(rng, lead + (c,), x_dtype)
        kernel = make(rng, (c + (wrong == "kernel"), k), k_dtype, 1 / np.sqrt(max(c, 1)))
        bias = make(rng, (k + (wrong == "bias"),), b_dtype) if use_bias else None
        if wrong == "bias" and not use_bias:  # no bias to get wrong
            wrong = None

        def ours(x, kernel, bias):
            return jb.dense(x, kernel, bias, activation=act, dtype=requested)

        def stock(x, kernel, bias):
            dt = compute_dtype(requested, x, kernel, bias)
            acc = accumulation(dt)
            y = jnp.matmul(jnp.asarray(x).astype(dt), jnp.asarray(kernel).astype(dt), preferred_element_type=acc)
            if bias is not None:
                y = y + jnp.asarray(bias).astype(acc)
            return REF_ACT[act](y).astype(dt)

        bad = first_bad(OP_DTYPES, x=x, kernel=kernel, bias=bias)
        if bad:
            return expect_refusal(lambda: ours(x, kernel, bias), TypeError, "jb.dense", f"{bad} must be")
        if wrong:
            return expect_refusal(lambda: ours(x, kernel, bias), ValueError, "jb.dense", wrong)
        if requested == "float16":
            return expect_refusal(lambda: ours(x, kernel, bias), TypeError, "jb.dense", "dtype")
        run = jax.jit(ours) if use_jit else ours
        dt = compute_dtype(requested, x, kernel, bias)
        assert_close(run(x, kernel, bias), stock(x, kernel, bias), tolerance(dt))
        if dt.name in ("float32", "float64") and all_float32(x, kernel, bias):
            args = (x, kernel) if bias is None else (x, kernel, bias)
            check_grads(lambda *a: ours(*a, *([None] * (3 - len(a)))), lambda *a: stock(*a, *([None] * (3 - len(a)))),
                        args, rng, 10 * tolerance(dt))


# --- brgemm -------------------------------------------------------------------------------


def brgemm_refusal(a, b, c, out_dtype, wrong_k):
    """The documented rules, in jb.brgemm's order of checks: ``(argument named, exception)``
    or None."""
    bad = first_bad(OP_DTYPES, a=a, b=b)
    if bad:
        return bad, TypeError
    ab = canonical(a)
    if ab != canonical(b):
        return "a and b", TypeError
    if wrong_k:
        return "reduced size K", ValueError
    if c is not None and canonical(c) not in OP_DTYPES:
        return "c", TypeError
    if out_dtype is not None and out_dtype not in OP_DTYPES:
        return "out_dtype", TypeError
    cd = None if c is None else canonical(c)
    if ab == "float64":
        if out_dtype not in (None, "float64"):
            return "out_dtype", TypeError
        return ("c", TypeError) if cd not in (None, "float64") else None
    if cd == "float64":
        return "c", TypeError
    if out_dtype is not None:
        if ab == "float32" and out_dtype != "float32":
            return "out_dtype", TypeError
        return ("c", TypeError) if cd not in (None, out_dtype) else None
    if ab == "float32" and cd not in (None, "float32"):
        return "c", TypeError
    return None


@profile(15)
@given(st.data())
def test_brgemm(data):
    d = data.draw
    lead = tuple(d(st.lists(sizes(3), max_size=2)))
    # each operand's leading dims: the full ones, a suffix, or some broadcast as 1
    def operand_lead():
        kind = d(st.sampled_from(["full", "suffix", "ones"]))
        if kind == "suffix":
            return lead[d(st.integers(0, len(lead))):]
        return tuple(1 if kind == "ones" and d(st.booleans()) else n for n in lead)
    nb, m, k, n = (d(sizes(5)) for _ in range(4))
    ab_dtype = d(mostly(["float32", "float32", "bfloat16", "float64"], "float16"))
    b_dtype = d(mostly([ab_dtype], "float32", "bfloat16", times=8))
    with_c = d(st.booleans())
    c_dtype = d(st.sampled_from(["float32", "float32", "bfloat16", "float64"]))
    out_dtype = d(mostly([None, None, "float32", "bfloat16"], "float16"))
    wrong_k, use_jit, x64, seed = d(mostly([False], True, times=10)), d(st.booleans()), d(x64_modes), \
        d(st.integers(0, 999))
    rng = np.random.default_rng(seed)
    with jax.enable_x64(x64):
        a = make(rng, operand_lead() + (nb, m, k), ab_dtype)
        b = make(rng, operand_lead() + (nb, k + wrong_k, n), b_dtype)
        c = make(rng, operand_lead() + (m, n), c_dtype) if with_c else None

        def ours(a, b, c):
            return jb.brgemm(a, b, c, out_dtype=out_dtype)

        refusal = brgemm_refusal(a, b, c, out_dtype, wrong_k)
        if refusal:
            return expect_refusal(lambda: ours(a, b, c), refusal[1], "jb.brgemm", refusal[0])
        ab = canonical(a)
        out = np.dtype(out_dtype or (canonical(c) if c is not None else ("float64" if ab == "float64"
                                                                          else "float32")))

        def stock(a, b, c):
            acc = accumulation(ab)
            y = jnp.einsum("...bmk,...bkn->...mn", jnp.asarray(a), jnp.asarray(b), preferred_element_type=acc)
            return (y if c is None else y + jnp.asarray(c).astype(acc)).astype(out)

        run = jax.jit(ours) if use_jit else ours
        assert_close(run(a, b, c), stock(a, b, c), tolerance(out if ab != "bfloat16" else ab) * max(1, k) ** 0.5)
        if ab in ("float32", "float64") and out == np.dtype(ab):
            args = (a, b) if c is None else (a, b, c)
            pad = lambda a: a if len(a) == 3 else (*a, None)  # noqa: E731
            check_grads(lambda *a: ours(*pad(a)), lambda *a: stock(*pad(a)), args, rng, 10 * tolerance(ab))


# --- conv2d -------------------------------------------------------------------------------

STRIDES = mostly([1, 1, 2, (1, 2), (2, 1), 3, np.int64(2)], 0, (1, -1), (1.5, 1.5), (2.0, 1), 1.5, (1, 1, 1))
PADDINGS = mostly(["SAME", "SAME", "VALID", "VALID", 0, 1, 2, ((1, 0), (0, 2)), (1, (2, 0))],
                  -1, ((-1, 0), (0, 0)), "CIRCULAR", ((1, 1, 1), (0, 0)))


def conv_refusal(x, kernel, bias, strides, padding, requested, r, s, wrong_c):
    """The expected refusal, in jb.conv2d's order of checks: ``(exception, words)``."""
    bad = first_bad(OP_DTYPES, x=x, kernel=kernel, bias=bias)
    if bad:
        return TypeError, f"{bad} must be"
    if wrong_c:
        return ValueError, "channels"
    if r < 1 or s < 1:
        return ValueError, "kernel"  # lax refuses an empty window
    if isinstance(strides, float) or (isinstance(strides, tuple) and len(strides) == 2
                                      and any(isinstance(v, float) for v in strides)):
        return TypeError, "strides"  # as lax
    if isinstance(strides, tuple) and len(strides) != 2:
        return ValueError, "strides"
    if min(strides if isinstance(strides, tuple) else (strides,)) < 1:
        return ValueError, "strides"  # lax refuses too
    if padding == "CIRCULAR" or padding == ((1, 1, 1), (0, 0)):
        return ValueError, "padding"
    flat = [padding] if isinstance(padding, int) else [v for p in padding if not isinstance(p, str)
                                                       for v in (p if isinstance(p, tuple) else (p,))]
    if not isinstance(padding, str) and min(flat) < 0:
        return ValueError, "padding"  # documented: paddings >= 0 (the modules crop)
    if requested == "float16":
        return TypeError, "dtype"
    return None


def lax_padding(padding):
    if isinstance(padding, str):
        return padding
    if isinstance(padding, int):
        return ((padding, padding),) * 2
    return tuple(p if isinstance(p, tuple) else (p, p) for p in padding)


@profile(15)
@given(st.data())
def test_conv2d(data):
    d = data.draw
    n, h, w, c, k = d(sizes(2)), d(sizes(7)), d(sizes(7)), d(sizes(5)), d(sizes(5))
    r, s = d(mostly([1, 2, 3], 0)), d(mostly([1, 2, 3], 0))
    strides, padding = d(STRIDES), d(PADDINGS)
    x_dtype, k_dtype, b_dtype = d(dtypes), d(kernel_friendly), d(kernel_friendly)
    use_bias, act, requested = d(st.booleans()), d(activations), d(requested_dtypes)
    wrong_c, use_jit, x64, seed = d(mostly([0], 1, times=10)), d(st.booleans()), d(x64_modes), \
        d(st.integers(0, 999))
    rng = np.random.default_rng(seed)
    with jax.enable_x64(x64):
        x = make(rng, (n, h, w, c), x_dtype)
        kernel = make(rng, (r, s, c + wrong_c, k), k_dtype, 1 / np.sqrt(max(r * s * c, 1)))
        bias = make(rng, (k,), b_dtype) if use_bias else None

        def ours(x, kernel, bias):
            return jb.conv2d(x, kernel, bias, strides=strides, padding=padding, activation=act, dtype=requested)

        refusal = conv_refusal(x, kernel, bias, strides, padding, requested, r, s, wrong_c)
        if refusal:
            return expect_refusal(lambda: ours(x, kernel, bias), refusal[0], "jb.conv2d", refusal[1])
        dt = compute_dtype(requested, x, kernel, bias)
        st_pair = strides if isinstance(strides, tuple) else (strides, strides)

        def stock(x, kernel, bias):
            acc = accumulation(dt)
            y = jax.lax.conv_general_dilated(jnp.asarray(x).astype(dt), jnp.asarray(kernel).astype(dt), st_pair,
                                             lax_padding(padding), dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                             preferred_element_type=acc)
            if bias is not None:
                y = y + jnp.asarray(bias).astype(acc)
            return REF_ACT[act](y).astype(dt)

        want, error = stock_outcome(lambda: stock(x, kernel, bias))
        if error is not None:  # stock refuses: so must we
            return expect_refusal(lambda: ours(x, kernel, bias), REFUSALS, "jb.conv2d")
        run = jax.jit(ours) if use_jit else ours
        assert_close(run(x, kernel, bias), want, tolerance(dt) * max(1, r * s * c) ** 0.5)
        if dt.name in ("float32", "float64") and all_float32(x, kernel, bias):
            args = (x, kernel) if bias is None else (x, kernel, bias)
            pad = lambda a: a if len(a) == 3 else (*a, None)  # noqa: E731
            check_grads(lambda *a: ours(*pad(a)), lambda *a: stock(*pad(a)), args, rng, 20 * tolerance(dt))


# --- lstm ---------------------------------------------------------------------------------


def stock_lstm(x, wi, wh, b, c0, h0, *, time_major, dt):
    """OptimizedLSTMCell's math in a scan, in the documented dtypes: products in the
    computation dtype accumulated in the cell state's (float32, or float64), h in ``dt``."""
    state = accumulation(dt)
    x, wi, wh = (jnp.asarray(a).astype(dt) for a in (x, wi, wh))

    def step(carry, xt):
        cs, h = carry
        z = (jnp.matmul(xt, wi, preferred_element_type=state) + jnp.matmul(h, wh, preferred_element_type=state)
             + jnp.asarray(b).astype(state))
        i, f, g, o = jnp.split(z, 4, axis=-1)
        cs = jax.nn.sigmoid(f) * cs + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = (jax.nn.sigmoid(o) * jnp.tanh(cs)).astype(dt)
        return (cs, h), h

    carry0 = (jnp.asarray(c0).astype(state), jnp.asarray(h0).astype(dt))
    carry, y = jax.lax.scan(step, carry0, x if time_major else jnp.swapaxes(x, 0, 1))
    return carry, (y if time_major else jnp.swapaxes(y, 0, 1))


@profile(8)
@given(st.data())
def test_lstm(data):
    d = data.draw
    n, t, c, k = d(sizes(3)), d(sizes(4)), d(sizes(5)), d(sizes(5))
    time_major, with_carry = d(st.booleans()), d(st.booleans())
    x_dtype, wi_dtype, wh_dtype, b_dtype = d(dtypes), d(kernel_friendly), d(kernel_friendly), d(kernel_friendly)
    carry_dtype = d(mostly(["float32", "float32", "bfloat16", "float64", "float16"], "int32"))
    requested = d(requested_dtypes)
    wrong = d(mostly([None], "kernel_i", "bias", "initial_carry[1] (h0)", times=20))
    second_order, x64, seed = d(mostly([False], True, times=3)), d(x64_modes), d(st.integers(0, 999))
    rng = np.random.default_rng(seed)
    with jax.enable_x64(x64):
        x = make(rng, (t, n, c) if time_major else (n, t, c), x_dtype)
        wi = make(rng, (c + (wrong == "kernel_i"), 4 * k), wi_dtype, 1 / np.sqrt(max(c, 1)))
        wh = make(rng, (k, 4 * k), wh_dtype, 1 / np.sqrt(max(k, 1)))
        b = make(rng, (4 * k + (wrong == "bias"),), b_dtype, 0.1)
        carry = (make(rng, (n, k), carry_dtype), make(rng, (n + (wrong == "initial_carry[1] (h0)"), k), carry_dtype))
        if not with_carry and wrong == "initial_carry[1] (h0)":
            wrong = None

        def ours(x, wi, wh, b, *carry):
            return jb.lstm(x, wi, wh, b, initial_carry=carry or None, time_major=time_major, dtype=requested)

        args = (x, wi, wh, b) + (carry if with_carry else ())
        bad = first_bad(OP_DTYPES, x=x, kernel_i=wi, kernel_h=wh, bias=b)
        if bad:
            return expect_refusal(lambda: ours(*args), TypeError, "jb.lstm", f"{bad} must be")
        if wrong in ("kernel_i", "bias"):
            return expect_refusal(lambda: ours(*args), ValueError, "jb.lstm", wrong)
        if requested == "float16":
            return expect_refusal(lambda: ours(*args), TypeError, "jb.lstm", "dtype")
        if with_carry and carry_dtype == "int32":
            return expect_refusal(lambda: ours(*args), TypeError, "jb.lstm", "initial_carry[0] (c0)")
        if wrong:
            return expect_refusal(lambda: ours(*args), ValueError, "jb.lstm", wrong)
        dt = compute_dtype(requested, x, wi, wh)
        if not with_carry:
            carry = (np.zeros((n, k)), np.zeros((n, k)))

        def stock(x, wi, wh, b, c0=carry[0], h0=carry[1]):
            return stock_lstm(x, wi, wh, b, c0, h0, time_major=time_major, dt=dt)

        assert_close(ours(*args), stock(*args), tolerance(dt, depth=2 * max(t, 1)))
        if dt.name in ("float32", "float64") and all_float32(*args):
            check_grads(ours, stock, args, rng, 50 * tolerance(dt))
            if second_order and min(n, t, c, k) > 0:
                w = weights(rng, jax.eval_shape(stock, *args))

                def penalty(f):
                    first = jax.grad(lambda *a: weighed_sum(f(*a), w), argnums=range(len(args)))
                    return jax.grad(lambda *a: sum(jnp.sum(jnp.sin(g)) for g in first(*a)), argnums=range(len(args)))
                assert_close(penalty(ours)(*args), penalty(stock)(*args), 200 * tolerance(dt))
