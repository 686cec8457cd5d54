"""jb.lstm and jb.nn.LSTM against stock Flax (nn.RNN(nn.OptimizedLSTMCell)) and a lax.scan
reference: outputs, final carry (or each sequence's own, with seq_lengths) and gradients;
layouts, initial carry, bf16, bad input."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_brgemm as jb
from flax.linen.recurrent import _select_last_carry
from stock_reference import scan_lstm


def stock(features, **kw):
    return nn.RNN(nn.OptimizedLSTMCell(features, dtype=kw.pop("dtype", None)), **kw)


def close(a, b, tol):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype, (u.shape, v.shape, u.dtype, v.dtype)
        np.testing.assert_allclose(np.asarray(u, np.float32), np.asarray(v, np.float32), rtol=tol, atol=tol)


def test_params_are_stock_params():
    x = jnp.ones((2, 3, 5))
    ours = jb.nn.LSTM(4).init(jax.random.key(1), x)
    theirs = stock(4).init(jax.random.key(1), x)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    close(ours, theirs, 0)  # same initializers, same keys: the same values
    assert set(ours["params"]["cell"]) == {"ii", "if", "ig", "io", "hi", "hf", "hg", "ho"}


@pytest.mark.parametrize("n,t,c,k", [(1, 1, 1, 1), (3, 5, 7, 9), (13, 4, 37, 33), (2, 3, 64, 70)])
def test_module_matches_stock_outputs_carry_grads(n, t, c, k):
    x = jax.random.normal(jax.random.key(n + t), (n, t, c))
    params = stock(k).init(jax.random.key(2), x)
    # Non-zero biases, so their gradients and effect are tested too.
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: v + 0.1 if p[-1].key == "bias" else v, params)
    ours, theirs = jb.nn.LSTM(k, return_carry=True), stock(k, return_carry=True)
    close(jax.jit(ours.apply)(params, x), jax.jit(theirs.apply)(params, x), 2e-5)

    def loss(m):
        def f(p, x):
            (c_, h_), y = m.apply(p, x)
            return jnp.sum(y * jnp.cos(y)) + jnp.sum(c_ ** 2) + 0.5 * jnp.sum(h_)
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    close(loss(ours)(params, x), loss(theirs)(params, x), 5e-5)


def test_time_major_initial_carry_multi_batch_dims():
    t, b1, b2, c, k = 4, 2, 3, 6, 5
    x = jax.random.normal(jax.random.key(0), (t, b1, b2, c))
    ks = jax.random.split(jax.random.key(1), 2)
    carry = (jax.random.normal(ks[0], (b1, b2, k)), jax.random.normal(ks[1], (b1, b2, k)))
    m_ours = jb.nn.LSTM(k, time_major=True, return_carry=True)
    m_stock = stock(k, time_major=True, return_carry=True)
    params = m_stock.init(jax.random.key(3), x)

    def run(m):
        return jax.jit(lambda p, x, cc: m.apply(p, x, initial_carry=cc))

    close(run(m_ours)(params, x, carry), run(m_stock)(params, x, carry), 2e-5)

    def grads(m):
        def f(p, x, cc):
            (c_, h_), y = m.apply(p, x, initial_carry=cc)
            return jnp.sum(jnp.sin(y)) + jnp.sum(c_ * h_)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    close(grads(m_ours)(params, x, carry), grads(m_stock)(params, x, carry), 5e-5)


def test_reverse_keep_order_and_seq_lengths():
    x = jax.random.normal(jax.random.key(0), (3, 6, 4))
    lengths = jnp.array([6, 2, 4])
    params = stock(5).init(jax.random.key(1), x)
    for kw in ({"reverse": True}, {"reverse": True, "keep_order": True}):
        for return_carry in (False, True):  # with it, each sequence's own last carry
            got = jb.nn.LSTM(5, return_carry=return_carry, **kw).apply(params, x, seq_lengths=lengths)
            want = stock(5, return_carry=return_carry, **kw).apply(params, x, seq_lengths=lengths)
            close(got, want, 2e-5)


def test_bf16_matches_stock_loosely():
    x = jax.random.normal(jax.random.key(0), (6, 5, 24))
    params = stock(20).init(jax.random.key(1), x)
    ours = jb.nn.LSTM(20, dtype=jnp.bfloat16, return_carry=True)
    theirs = stock(20, dtype=jnp.bfloat16, return_carry=True)
    got, want = jax.jit(ours.apply)(params, x), jax.jit(theirs.apply)(params, x)
    close(got, want, 5e-2)

    def loss(m):
        return jax.jit(jax.grad(lambda p, x: jnp.sum(m.apply(p, x)[1] ** 2), argnums=(0, 1)))

    g_ours, g_stock = loss(ours)(params, x), loss(theirs)(params, x)
    for u, v in zip(jax.tree_util.tree_leaves(g_ours), jax.tree_util.tree_leaves(g_stock), strict=True):
        assert u.dtype == v.dtype
        scale = float(jnp.max(jnp.abs(v.astype(jnp.float32)))) + 1e-3
        assert float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32)))) < 0.1 * scale


def _args(key, n, t, c, k, time_major=False, dtype=jnp.float32):
    ks = jax.random.split(key, 6)
    x = jax.random.normal(ks[0], (t, n, c) if time_major else (n, t, c), dtype)
    wi = jax.random.normal(ks[1], (c, 4 * k)) / np.sqrt(c)
    wh = jax.random.normal(ks[2], (k, 4 * k)) / np.sqrt(k)
    b = 0.1 * jax.random.normal(ks[3], (4 * k,))
    c0 = jax.random.normal(ks[4], (n, k))
    h0 = jax.random.normal(ks[5], (n, k))
    return x, wi, wh, b, c0, h0


def _loss(fn, time_major):
    def f(x, wi, wh, b, c0, h0):
        (c, h), y = fn(x, wi, wh, b, c0, h0)
        return jnp.sum(y * jnp.sin(3 * y)) + jnp.sum(jnp.tanh(c)) + jnp.sum(h * h)
    return jax.jit(jax.grad(f, argnums=range(6)))


def _ours(time_major):
    return lambda x, wi, wh, b, c0, h0: jb.lstm(x, wi, wh, b, initial_carry=(c0, h0), time_major=time_major)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(n=st.integers(1, 20), t=st.integers(1, 6), c=st.integers(1, 40), k=st.integers(1, 40),
       time_major=st.booleans())
def test_lstm_matches_scan(n, t, c, k, time_major):
    args = _args(jax.random.key(n * 7 + t), n, t, c, k, time_major)
    ref = lambda *a: scan_lstm(*a, time_major=time_major)  # noqa: E731
    close(jax.jit(_ours(time_major))(*args), jax.jit(ref)(*args), 2e-5)
    close(_loss(_ours(time_major), time_major)(*args), _loss(ref, time_major)(*args), 1e-4)


def test_lstm_default_carry_is_zeros_and_dtypes():
    x, wi, wh, b, c0, h0 = _args(jax.random.key(0), 3, 4, 5, 6)
    (c, h), y = jb.lstm(x, wi, wh, b)
    (c_r, h_r), y_r = scan_lstm(x, wi, wh, b, jnp.zeros_like(c0), jnp.zeros_like(h0))
    close(((c, h), y), ((c_r, h_r), y_r), 2e-5)
    (c, h), y = jb.lstm(x.astype(jnp.bfloat16), wi, wh, b, dtype=jnp.bfloat16)
    assert (c.dtype, h.dtype, y.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)


def test_lstm_bf16_vs_scan():
    args = _args(jax.random.key(0), 9, 5, 33, 17)
    (c, h), y = jb.lstm(args[0].astype(jnp.bfloat16), *args[1:4], initial_carry=args[4:], dtype=jnp.bfloat16)
    (c_r, h_r), y_r = scan_lstm(*args)
    for u, v in ((c, c_r), (h, h_r), (y, y_r)):
        np.testing.assert_allclose(np.asarray(u, np.float32), v, atol=6e-2, rtol=6e-2)


def test_lstm_empty_batch_and_sequence():
    x, wi, wh, b, c0, h0 = _args(jax.random.key(0), 2, 3, 4, 5)
    (c, h), y = jb.lstm(x[:0], wi, wh, b)
    assert y.shape == (0, 3, 5) and c.shape == (0, 5) and h.shape == (0, 5)
    (c, h), y = jb.lstm(x[:, :0], wi, wh, b, initial_carry=(c0, h0))
    assert y.shape == (2, 0, 5)
    close((c, h), (c0, h0), 0)


@pytest.mark.parametrize("time_major", [False, True])
def test_lstm_vmap_folds_and_differentiates(time_major):
    # Shared weights: the mapped axis is folded into N (one call); mapped weights: one call
    # per element. Outputs and gradients (from y and the final carry) as the scan's.
    args = _args(jax.random.key(0), 3, 4, 5, 6, time_major)
    xs = jnp.stack([args[0], 2 * args[0]])
    c0s = jnp.stack([args[4], -args[4]])
    ours, ref = _ours(time_major), lambda *a: scan_lstm(*a, time_major=time_major)  # noqa: E731
    shared = (0, None, None, None, 0, None)
    close(jax.jit(jax.vmap(ours, shared))(xs, *args[1:4], c0s, args[5]),
          jax.vmap(ref, shared)(xs, *args[1:4], c0s, args[5]), 2e-5)
    close(jax.jit(jax.vmap(_loss(ours, time_major), shared))(xs, *args[1:4], c0s, args[5]),
          jax.vmap(_loss(ref, time_major), shared)(xs, *args[1:4], c0s, args[5]), 1e-4)
    hlo = jax.jit(jax.vmap(ours, shared)).lower(xs, *args[1:4], c0s, args[5]).as_text()
    assert hlo.count("jb_lstm_fwd") == 1 and "while" not in hlo
    mapped = (None, 0, None, None, None, None)
    wis = jnp.stack([args[1], 0.5 * args[1]])
    close(jax.vmap(_loss(ours, time_major), mapped)(args[0], wis, *args[2:]),
          jax.vmap(_loss(ref, time_major), mapped)(args[0], wis, *args[2:]), 1e-4)


@pytest.mark.parametrize("time_major", [False, True])
def test_lstm_gradients_through_padded_gate_gradient_rows(time_major):
    # 4K = 1024 fp32 values: bptt's da rows fall on a 4 KiB period, so the layer pads them
    # and the passes after it skip the padding; under vmap db sums the first 4K too.
    from jax_brgemm import _native
    k, t = 256, 2
    assert _native.lstm_da_width(t, 5, k, False, time_major) > 4 * k
    args = _args(jax.random.key(3), 5, t, 7, k, time_major)
    ours, ref = _ours(time_major), lambda *a: scan_lstm(*a, time_major=time_major)  # noqa: E731
    close(_loss(ours, time_major)(*args), _loss(ref, time_major)(*args), 1e-4)
    shared = (0, None, None, None, 0, None)
    xs, c0s = jnp.stack([args[0], -args[0]]), jnp.stack([args[4], 0.5 * args[4]])
    close(jax.jit(jax.vmap(_loss(ours, time_major), shared))(xs, *args[1:4], c0s, args[5]),
          jax.vmap(_loss(ref, time_major), shared)(xs, *args[1:4], c0s, args[5]), 1e-4)


def test_lstm_vmap_with_padded_saved_gate_blocks():
    # K = 130 saves the gates in K-blocks whose last one is padded; under vmap the folded
    # forward's blocks are split back per mapped element and folded again for the backward.
    from jax_brgemm import _native
    k = 130
    _, blocks, _, width = _native.lstm_saved_gates_shape(2, 3, k, False)
    assert blocks > 1 and blocks * width // 4 > k
    args = _args(jax.random.key(5), 3, 2, 7, k)
    ours, ref = _ours(False), lambda *a: scan_lstm(*a)  # noqa: E731
    shared = (0, None, None, None, 0, None)
    xs, c0s = jnp.stack([args[0], -args[0]]), jnp.stack([args[4], 0.5 * args[4]])
    close(jax.jit(jax.vmap(_loss(ours, False), shared))(xs, *args[1:4], c0s, args[5]),
          jax.vmap(_loss(ref, False), shared)(xs, *args[1:4], c0s, args[5]), 1e-4)


def test_lstm_bad_input():
    x, wi, wh, b, c0, h0 = _args(jax.random.key(0), 2, 3, 4, 5)
    with pytest.raises(ValueError, match="rank 3"):
        jb.lstm(x[0], wi, wh, b)
    with pytest.raises(ValueError, match="kernel_i"):
        jb.lstm(x, wi[:3], wh, b)
    with pytest.raises(ValueError, match="kernel_h"):
        jb.lstm(x, wi, wh[:, :7], b)
    with pytest.raises(ValueError, match="bias"):
        jb.lstm(x, wi, wh, b[:3])
    with pytest.raises(ValueError, match="c0"):
        jb.lstm(x, wi, wh, b, initial_carry=(c0[:1], h0))
    with pytest.raises(ValueError, match="pair"):
        jb.lstm(x, wi, wh, b, initial_carry=c0)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        jb.lstm(x.astype(jnp.int32), wi, wh, b)
    with pytest.raises(TypeError, match="jb.lstm: dtype must be float32 or bfloat16"):
        jb.lstm(x, wi, wh, b, dtype=jnp.float16)
    with pytest.raises(TypeError, match="jb.lstm: kernel_i must be float32 or bfloat16, got float16"):
        jb.lstm(x, wi.astype(jnp.float16), wh, b)
    with pytest.raises(ValueError, match=r"kernel_i must have shape \(C, 4K\)"):
        jb.lstm(x, wi[:-1], wh, b)
    with pytest.raises(ValueError, match="inputs must be"):
        jb.nn.LSTM(5).init(jax.random.key(0), x[0])


@pytest.mark.parametrize("n,t,c,k", [(0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0), (0, 0, 0, 0)])
@pytest.mark.parametrize("time_major", [False, True])
def test_lstm_zero_sizes_compute_what_the_scan_computes(n, t, c, k, time_major):
    """Any size of 0 (N, T, C or K) gives the stock scan's result and gradients."""
    args = _args(jax.random.key(1), n, t, c, k, time_major)
    ref = lambda *a: scan_lstm(*a, time_major=time_major)  # noqa: E731
    close(_ours(time_major)(*args), ref(*args), 2e-5)
    close(_loss(_ours(time_major), time_major)(*args), _loss(ref, time_major)(*args), 1e-5)


def _penalty(fn, time_major):
    """grad of grad: the first derivative (w.r.t. x and the weights) inside a loss,
    differentiated again w.r.t. every argument, the initial carry included."""
    first = jax.grad(lambda *a: _scalar(fn(*a)), argnums=(0, 1, 2))

    def outer(*a):
        return sum(jnp.sum(jnp.sin(g)) for g in first(*a))
    return jax.grad(outer, argnums=range(6))


def _scalar(out):
    (c, h), y = out
    return jnp.sum(y * jnp.sin(3 * y)) + jnp.sum(jnp.tanh(c) * h) + jnp.sum(h * h)


@pytest.mark.slow  # 35 s; the quick tier has grad of grad in tests/nn/test_nn_lstm.py
@pytest.mark.parametrize("time_major", [False, True])
@pytest.mark.parametrize("n,t,c,k", [(3, 4, 5, 6), (2, 1, 3, 17)])
def test_lstm_grad_of_grad_matches_the_scan(n, t, c, k, time_major):
    args = _args(jax.random.key(n + k), n, t, c, k, time_major)
    ref = lambda *a: scan_lstm(*a, time_major=time_major)  # noqa: E731
    want = jax.jit(_penalty(ref, time_major))(*args)
    close(jax.jit(_penalty(_ours(time_major), time_major))(*args), want, 2e-4)
    # under vmap with shared weights too
    shared = (0, None, None, None, 0, None)
    xs, c0s = jnp.stack([args[0], -args[0]]), jnp.stack([args[4], 0.5 * args[4]])
    close(jax.vmap(_penalty(_ours(time_major), time_major), shared)(xs, *args[1:4], c0s, args[5]),
          jax.vmap(_penalty(ref, time_major), shared)(xs, *args[1:4], c0s, args[5]), 2e-4)


@pytest.mark.slow  # ~16 s; grad of grad runs in the quick tier
def test_lstm_third_order_matches_the_scan():
    args = _args(jax.random.key(9), 2, 3, 3, 4)
    x = args[0]

    def third(fn):
        f = lambda x: _scalar(fn(x, *args[1:]))  # noqa: E731
        return jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x) ** 2))(x)
    close(third(_ours(False)), third(scan_lstm), 2e-4)


def test_lstm_first_order_backward_stays_on_the_kernels():
    """The backward of a first-order gradient is the bptt call and two FC passes, no scan."""
    args = _args(jax.random.key(0), 3, 4, 5, 6)
    hlo = _loss(_ours(False), False).lower(*args).as_text()
    assert hlo.count("jb_lstm_fwd") == 1 and hlo.count("jb_lstm_bptt") == 1
    assert "while" not in hlo


# --- seq_lengths: each row's carry after its own last step ---------------------------------


def _scan_seq_lengths(x, wi, wh, b, c0, h0, time_major, seq_lengths):
    """The stock result: the carry after every step (the scan over each prefix), selected
    per row by flax.linen.RNN's own _select_last_carry, and every output."""
    t = x.shape[0] if time_major else x.shape[1]
    prefix = (lambda s: x[:s]) if time_major else (lambda s: x[:, :s])
    carries = [scan_lstm(prefix(s), wi, wh, b, c0, h0, time_major)[0] for s in range(1, t + 1)]
    stacked = tuple(jnp.stack([carry[i] for carry in carries]) for i in (0, 1))
    return _select_last_carry(stacked, seq_lengths), scan_lstm(x, wi, wh, b, c0, h0, time_major)[1]


def _with_lengths(lengths, time_major):
    def ours(x, wi, wh, b, c0, h0):
        return jb.lstm(x, wi, wh, b, initial_carry=(c0, h0), time_major=time_major,
                       seq_lengths=lengths)

    def ref(*args):
        return _scan_seq_lengths(*args, time_major, lengths)
    return ours, ref


# 0 and T + 3 are past the ends (flax: the last step's carry, no gradient through it), -1 the
# step before the last.
@pytest.mark.parametrize("n,t,c,k,time_major,lengths", [
    (5, 4, 3, 6, False, [0, 1, 4, 2, 7]),
    (7, 5, 9, 17, True, [5, 1, 3, -1, 2, 5, 4]),
    (3, 1, 2, 3, False, [1, 0, 1]),
])
def test_seq_lengths_carry_and_gradients_match_the_stock_selection(n, t, c, k, time_major, lengths):
    args = _args(jax.random.key(n + t), n, t, c, k, time_major)
    ours, ref = _with_lengths(jnp.array(lengths), time_major)
    close(jax.jit(ours)(*args), ref(*args), 2e-5)
    close(_loss(ours, time_major)(*args), _loss(ref, time_major)(*args), 1e-4)
    hlo = _loss(ours, time_major).lower(*args).as_text()
    assert hlo.count("jb_lstm_fwd") == 1 and hlo.count("jb_lstm_bptt") == 1 and "while" not in hlo


@pytest.mark.slow  # ~17 s; fp32 seq_lengths runs in the quick tier
def test_seq_lengths_bf16_vs_the_stock_selection():
    args = _args(jax.random.key(4), 6, 5, 19, 21)
    lengths = jnp.array([5, 1, 3, 2, 4, 5])
    x16 = args[0].astype(jnp.bfloat16)
    (c, h), y = jb.lstm(x16, *args[1:4], initial_carry=args[4:], dtype=jnp.bfloat16, seq_lengths=lengths)
    (c_r, h_r), y_r = _scan_seq_lengths(*args, False, lengths)
    assert (c.dtype, h.dtype) == (jnp.float32, jnp.bfloat16)
    for u, v in ((c, c_r), (h, h_r), (y, y_r)):
        np.testing.assert_allclose(np.asarray(u, np.float32), v, atol=6e-2, rtol=6e-2)
    ours, ref = _with_lengths(lengths, False)

    def grads(fn):
        return jax.grad(lambda *a: _scalar(fn(*a)), argnums=range(6))(*a16)
    a16 = (x16, *args[1:])
    for u, v in zip(grads(ours), grads(lambda x, *a: ref(x.astype(jnp.float32), *a)), strict=True):
        scale = float(jnp.max(jnp.abs(v))) + 1e-3
        assert float(jnp.max(jnp.abs(u.astype(jnp.float32) - v))) < 0.1 * scale


@pytest.mark.slow  # ~23 s
def test_seq_lengths_grad_of_grad_and_vmap_match_the_stock_selection():
    args = _args(jax.random.key(8), 3, 4, 5, 6)
    lengths = jnp.array([2, 4, 1])
    ours, ref = _with_lengths(lengths, False)
    close(jax.jit(_penalty(ours, False))(*args), _penalty(ref, False)(*args), 2e-4)
    # mapped inputs and lengths, shared weights: one folded call each way
    xs, ls = jnp.stack([args[0], -args[0]]), jnp.stack([lengths, jnp.array([4, 0, 3])])

    def grads(pick):  # pick: 0 ours, 1 the stock selection
        def one(x, lengths):
            fn = _with_lengths(lengths, False)[pick]
            return jax.grad(lambda *a: _scalar(fn(*a)), argnums=range(6))(x, *args[1:])
        return jax.vmap(one)

    close(jax.jit(grads(0))(xs, ls), grads(1)(xs, ls), 1e-4)
    hlo = jax.jit(grads(0)).lower(xs, ls).as_text()
    assert hlo.count("jb_lstm_fwd") == 1 and hlo.count("jb_lstm_bptt") == 1


def test_seq_lengths_zero_sizes_and_bad_input():
    x, wi, wh, b, c0, h0 = _args(jax.random.key(0), 2, 3, 4, 5)
    lengths = jnp.array([3, 1])
    # C = 0 computes in XLA (the reference), with the same selection
    got = jb.lstm(x[..., :0], wi[:0], wh, b, initial_carry=(c0, h0), seq_lengths=lengths)
    close(got, _scan_seq_lengths(x[..., :0], wi[:0], wh, b, c0, h0, False, lengths), 2e-5)
    (c, h), y = jb.lstm(x[:0], wi, wh, b, seq_lengths=jnp.zeros((0,), jnp.int32))
    assert c.shape == h.shape == (0, 5) and y.shape == (0, 3, 5)
    with pytest.raises(TypeError, match="jb.lstm: seq_lengths must be an integer array, got float32"):
        jb.lstm(x, wi, wh, b, seq_lengths=lengths.astype(jnp.float32))
    with pytest.raises(TypeError, match="seq_lengths must be an integer array, got bool"):
        jb.lstm(x, wi, wh, b, seq_lengths=lengths > 1)
    with pytest.raises(ValueError, match=r"seq_lengths must have shape \(N,\) = \(2,\), got \(2, 1\)"):
        jb.lstm(x, wi, wh, b, seq_lengths=lengths[:, None])
    with pytest.raises(ValueError, match="at least one time step"):
        jb.lstm(x[:, :0], wi, wh, b, seq_lengths=lengths)
