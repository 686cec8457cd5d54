"""Forward mode and mixed orders on the kernels: jax.jvp, jax.linearize, jax.jacfwd,
jax.hessian, Hessian-vector products (forward over reverse) and reverse over forward of
jb.brgemm, jb.dense (every activation, with and without bias), jb.conv2d (every convolution
kind), jb.conv3d and jb.lstm (seq_lengths, time-major, initial carry, vmap, emulated
precision) against the same transformations of stock JAX, in float32 and bfloat16 over odd
shapes; the tangents run on the kernels (their custom calls in the lowered program, no stock
dot, convolution or scan beside them), and reverse mode keeps its calls."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_brgemm as jb
from jax_brgemm import precision
from stock_reference import assert_close, conv_general_dilated, loss

HI = lax.Precision.HIGHEST
F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {F32: 2e-4, BF16: 4e-2}


def arrays(shapes, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(scale * rng.standard_normal(s), dtype) for s in shapes)


def kernel_calls(fn, *args):
    """{target: count} of the jb_* custom calls in fn's lowered program, and its text."""
    text = jax.jit(fn).lower(*args).as_text()
    return Counter(re.findall(r"custom_call @(jb_\w+)", text)), text


def check_modes(ours, theirs, args, tol, *, hessian_arg=None):
    """``ours`` equals ``theirs`` under jvp, linearize, jacfwd, HVP (forward over reverse),
    reverse over forward and, for argument ``hessian_arg``, jax.hessian of a scalar loss."""
    tangents = arrays([a.shape for a in args], args[0].dtype, seed=1, scale=0.5)
    tangents = tuple(t.astype(a.dtype) for t, a in zip(tangents, args))
    argnums = tuple(range(len(args)))
    jvp = lambda f: jax.jit(lambda a, t: jax.jvp(f, a, t))(args, tangents)  # noqa: E731
    (y, t), (y_want, t_want) = jvp(ours), jvp(theirs)
    assert t.dtype == t_want.dtype and t.shape == t_want.shape
    assert_close(y, y_want, tol)
    assert_close(t, t_want, tol)

    _, lin = jax.linearize(ours, *args)
    assert_close(lin(*tangents), t_want, tol)

    jac = lambda f: jax.jit(jax.jacfwd(f, argnums))(*args)  # noqa: E731
    for got, want in zip(jac(ours), jac(theirs), strict=True):
        assert_close(got, want, tol)

    hvp = lambda f: jax.jit(lambda a, t: jax.jvp(jax.grad(loss(f), argnums), a, t)[1])(args, tangents)  # noqa: E731
    for got, want in zip(hvp(ours), hvp(theirs), strict=True):
        assert_close(got, want, tol)

    def reverse_over_forward(f):
        tangent_loss = lambda *a: loss(lambda *b: jax.jvp(f, b, tangents)[1])(*a)  # noqa: E731
        return jax.jit(jax.grad(tangent_loss, argnums))(*args)

    for got, want in zip(reverse_over_forward(ours), reverse_over_forward(theirs), strict=True):
        assert_close(got, want, tol)

    if hessian_arg is not None:
        hess = lambda f: jax.jit(jax.hessian(loss(f), hessian_arg))(*args)  # noqa: E731
        assert_close(hess(ours), hess(theirs), tol)
    return tangents


def assert_on_kernels(f, args, tangents, targets, stock_op):
    """The JVP's program calls ``targets`` and no stock ``stock_op``; the HVP's too."""
    calls, text = kernel_calls(lambda a, t: jax.jvp(f, a, t), args, tangents)
    assert set(targets) <= set(calls), calls
    assert stock_op not in text
    argnums = tuple(range(len(args)))
    calls, text = kernel_calls(lambda a, t: jax.jvp(jax.grad(loss(f), argnums), a, t), args, tangents)
    assert set(targets) <= set(calls), calls
    assert stock_op not in text


# --- jb.brgemm ---------------------------------------------------------------------------


def brgemm_reference(a, b, c=None):
    y = jnp.einsum("...bmk,...bkn->...mn", a, b, precision=HI, preferred_element_type=F32)
    return y if c is None else y + c


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shapes", [
    ((3, 5, 7), (3, 7, 2)),                     # odd sizes
    ((2, 1, 2, 3, 4), (3, 2, 4, 5)),            # leading dims broadcast
    ((2, 3, 5, 4), (2, 3, 4, 3), (2, 5, 3)),    # with the accumulator c
])
def test_brgemm(dtype, shapes):
    args = arrays(shapes[:2], dtype) + arrays(shapes[2:], F32, seed=2)
    tangents = check_modes(jb.brgemm, brgemm_reference, args, TOL[dtype], hessian_arg=1)
    target = "jb_brgemm_acc" if len(shapes) == 3 else "jb_brgemm"  # the tangents accumulate into c
    assert_on_kernels(jb.brgemm, args, tangents, {target}, "dot_general")


def test_brgemm_grad_keeps_its_calls():
    """Reverse mode: the forward and one call per operand gradient, as before."""
    a, b, c = arrays(((2, 3, 5, 4), (2, 3, 4, 3), (2, 5, 3)), F32)
    calls, _ = kernel_calls(jax.grad(loss(jb.brgemm), (0, 1, 2)), a, b, c)
    assert calls == {"jb_brgemm": 2, "jb_brgemm_acc": 1}


# --- jb.dense ------------------------------------------------------------------------------

ACTS = {None: lambda v: v, "relu": jax.nn.relu, "gelu": jax.nn.gelu, "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}


def dense_reference(activation):
    def f(x, kernel, bias=None):
        dtype = x.dtype
        y = jnp.matmul(x.astype(F32), kernel.astype(dtype).astype(F32), precision=HI)
        y = y if bias is None else y + bias.astype(F32)
        return ACTS[activation](y).astype(dtype)
    return f


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("activation", list(ACTS))
def test_dense(dtype, use_bias, activation):
    shapes = ((2, 3, 7), (7, 5)) + (((5,),) if use_bias else ())
    args = arrays(shapes, dtype)
    ours = lambda *a: jb.dense(*a, activation=activation)  # noqa: E731
    tangents = check_modes(ours, dense_reference(activation), args, TOL[dtype], hessian_arg=1)
    targets = {"jb_fc_fwd"} | ({"jb_fc_act_grad"} if activation else set())
    assert_on_kernels(ours, args, tangents, targets, "dot_general")


def test_dense_float32_kernel_with_bfloat16_compute():
    """The kernel's tangent is rounded as the kernel is, in the call; results in bf16."""
    x, = arrays(((4, 6),), BF16)
    kernel, bias = arrays(((6, 3), (3,)), F32, seed=3)
    ours = lambda x, w, b: jb.dense(x, w, b, activation="tanh", dtype=BF16)  # noqa: E731
    theirs = lambda x, w, b: jnp.tanh(  # noqa: E731
        jnp.matmul(x.astype(F32), w.astype(BF16).astype(F32), precision=HI) + b).astype(BF16)
    args = (x, kernel, bias)
    t, t_want = (jax.jvp(f, args, tuple(a * 0.5 for a in args))[1] for f in (ours, theirs))
    assert t.dtype == BF16
    assert_close(t, t_want, TOL[BF16])


def test_dense_grad_keeps_its_calls():
    """Reverse mode is the transpose of the tangent: the forward, the activation gradient,
    backward by data and weight update (bias gradient fused), and no backward by data for
    an input nobody differentiates."""
    x, kernel, bias = arrays(((8, 6), (6, 4), (4,)), F32)
    f = lambda x, w, b: jb.dense(x, w, b, activation="gelu")  # noqa: E731
    calls, _ = kernel_calls(jax.grad(loss(f), (0, 1, 2)), x, kernel, bias)
    assert calls == {"jb_fc_fwd": 1, "jb_fc_act_grad": 1, "jb_fc_bwd": 1, "jb_fc_upd": 1}
    calls, _ = kernel_calls(jax.grad(loss(f), (1, 2)), x, kernel, bias)
    assert calls == {"jb_fc_fwd": 1, "jb_fc_act_grad": 1, "jb_fc_upd": 1}


def test_dense_under_vmap_and_jvp_in_either_order():
    x, kernel, bias = arrays(((3, 4, 6), (6, 5), (5,)), F32)
    tx = 0.5 * x
    for act in ("relu", "gelu"):
        ours = lambda x: jb.dense(x, kernel, bias, activation=act)  # noqa: E731, B023
        theirs = lambda x: dense_reference(act)(x, kernel, bias)  # noqa: E731, B023
        for f in (lambda g: jax.vmap(lambda x, t: jax.jvp(g, (x,), (t,))[1]),
                  lambda g: lambda x, t: jax.jvp(jax.vmap(g), (x,), (t,))[1]):
            assert_close(jax.jit(f(ours))(x, tx), f(theirs)(x, tx), 2e-4)


def test_dense_exact_on_infinity_under_jvp(monkeypatch):
    """The emulated precision's lax.cond (an infinite operand: exact products) has a JVP:
    the infinite rows stay infinite, the others' tangents are the emulated products'."""
    monkeypatch.setattr(precision, "EMULATE", True)
    x, kernel = arrays(((4, 6), (6, 3)), F32)
    x = x.at[0, 0].set(jnp.inf)
    f = lambda x, w: jb.dense(x, w, precision="BF16_BF16_F32_X3")  # noqa: E731
    y, t = jax.jit(lambda x, w: jax.jvp(f, (x, w), (jnp.zeros_like(x), w)))(x, kernel)
    assert np.isinf(np.asarray(y)[0]).any() and np.isfinite(np.asarray(y)[1:]).all()
    assert_close(np.asarray(t)[1:], np.asarray(jnp.matmul(x, kernel, precision=HI))[1:], 1e-4)


# --- jb.conv2d and jb.conv3d ------------------------------------------------------------------

CONV_KINDS = {
    "same": dict(),
    "strided_valid_gelu": dict(strides=(2, 1), padding="VALID", activation="gelu"),
    "dilated_grouped_tanh": dict(padding=((1, 2), (0, 1)), rhs_dilation=(2, 1), feature_group_count=2,
                                 activation="tanh"),
    "depthwise_relu": dict(feature_group_count=4, activation="relu"),
    "input_dilated": dict(padding=((1, 1), (2, 1)), lhs_dilation=(2, 2)),
    "input_dilated_strided": dict(strides=(2, 2), padding=((1, 1), (1, 1)), lhs_dilation=(2, 2),
                                  activation="sigmoid"),
}


def conv_reference(strides=(1, 1), padding="SAME", activation=None, rhs_dilation=(1, 1), lhs_dilation=(1, 1),
                   feature_group_count=1):
    def f(x, w, b):
        dtype = x.dtype
        y = conv_general_dilated(x, w.astype(dtype), strides, padding, lhs_dilation=lhs_dilation,
                                 rhs_dilation=rhs_dilation, feature_group_count=feature_group_count,
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=HI,
                                 preferred_element_type=F32)
        return ACTS[activation](y + b.astype(F32)).astype(dtype)
    return f


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("kind", list(CONV_KINDS))
def test_conv2d(dtype, kind):
    kw = CONV_KINDS[kind]
    groups = kw.get("feature_group_count", 1)
    args = arrays(((2, 5, 6, 4), (3, 2, 4 // groups, 4 if groups == 4 else 6)), dtype, scale=0.5)
    args += arrays(((args[1].shape[-1],),), dtype, seed=2)
    ours = lambda *a: jb.conv2d(*a, **kw)  # noqa: E731
    tangents = check_modes(ours, conv_reference(**kw), args, TOL[dtype], hessian_arg=2)
    # an input-dilated convolution is the backward by data of the one it transposes
    target = "jb_conv_bwd" if kind == "input_dilated" else "jb_conv_fwd"
    assert_on_kernels(ours, args, tangents, {target}, "stablehlo.convolution")


def test_conv2d_grad_keeps_its_calls():
    x, w, b = arrays(((2, 6, 6, 3), (3, 3, 3, 5), (5,)), F32)
    f = lambda x, w, b: jb.conv2d(x, w, b, activation="relu")  # noqa: E731
    calls, _ = kernel_calls(jax.grad(loss(f), (0, 1, 2)), x, w, b)
    assert calls == {"jb_conv_fwd": 1, "jb_fc_act_grad": 1, "jb_conv_bwd": 1, "jb_conv_upd": 1}


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_conv3d(dtype):
    args = arrays(((1, 4, 5, 3, 2), (2, 3, 1, 2, 3), (3,)), dtype, scale=0.5)
    kw = dict(strides=(1, 2, 1), padding="SAME", activation="tanh")

    def theirs(x, w, b):
        y = conv_general_dilated(x, w, kw["strides"], "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                 precision=HI, preferred_element_type=F32)
        return jnp.tanh(y + b.astype(F32)).astype(x.dtype)

    ours = lambda *a: jb.conv3d(*a, **kw)  # noqa: E731
    tangents = check_modes(ours, theirs, args, TOL[dtype])
    assert_on_kernels(ours, args, tangents, {"jb_conv_fwd"}, "stablehlo.convolution")


# --- jb.dot_product_attention: the output on the kernels, reverse mode too; the forward-mode
# tangent and second derivatives by the stock formula (in XLA) -----------------------------------


def attention_reference(**kw):
    def f(q, k, v, *bias):
        groups = q.shape[-2] // k.shape[-2]
        k, v = (jnp.repeat(a, groups, axis=-2) for a in (k, v))
        return jax.nn.dot_product_attention(q, k, v, *bias, **kw)
    return f


ATTENTION_KINDS = {
    "plain": dict(),
    "bias": dict(bias=(1, 4, 5, 6)),
    "mask_causal_gqa": dict(mask=(1, 1, 5, 6), is_causal=True, kv_heads=2),
    "bias_and_mask": dict(bias=(2, 1, 1, 6), mask=(2, 4, 5, 6)),
}


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("kind", list(ATTENTION_KINDS))
def test_dot_product_attention(dtype, kind):
    spec = dict(ATTENTION_KINDS[kind])
    heads = spec.pop("kv_heads", 4)
    args = arrays(((2, 5, 4, 3), (2, 6, heads, 3), (2, 6, heads, 3)), dtype)
    if "bias" in spec:
        args += arrays((spec.pop("bias"),), F32, seed=4)
    if "mask" in spec:
        spec["mask"] = jnp.asarray(np.random.default_rng(5).random(spec["mask"]) > 0.3)
    ours = lambda *a: jb.dot_product_attention(*a, **spec)  # noqa: E731
    check_modes(ours, attention_reference(**spec), args, TOL[dtype] * (2 if dtype == BF16 else 1))
    calls, _ = kernel_calls(lambda *a: jax.jvp(ours, a, a), *args)
    assert calls == {"jb_attention_fwd": 1, "jb_attention_jvp": 1}  # the tangent on the kernels too
    calls, _ = kernel_calls(jax.grad(loss(ours), tuple(range(len(args)))), *args)
    assert calls == {"jb_attention_fwd": 1, "jb_attention_bwd": 1}


# --- jb.lstm: the tangent on the kernels (FC passes over every step and the tangent pass);
# second derivatives of the tangent by the reference scan (in XLA) ------------------------------


def lstm_reference(seq_lengths=None, time_major=False):
    from jax_brgemm.ops import lstm as lstm_ops

    def f(x, wi, wh, b, c0, h0):
        n, t = (x.shape[1], x.shape[0]) if time_major else x.shape[:2]
        steps = lstm_ops._NO_STEPS if seq_lengths is None else lstm_ops.last_steps(seq_lengths, n, t, "test")
        c0 = c0.astype(F32)
        return lstm_ops.reference(x, wi.astype(x.dtype), wh.astype(x.dtype), b.astype(F32), c0, h0, time_major,
                                  steps)
    return f


def flat(f):
    """f's outputs (the carry and y) as one float32 vector."""
    return lambda *a: jnp.concatenate([jnp.ravel(o).astype(F32) for o in jax.tree.leaves(f(*a))])


def lstm_case(dtype, n, t, c, k, time_major=False, seq_lengths=None, carry=True, **kw):
    """(ours, theirs, args): jb.lstm and the reference scan over x, both kernels, the bias
    and, with ``carry``, the initial carry (zeros without)."""
    x, = arrays(((t, n, c) if time_major else (n, t, c),), dtype)
    args = (x,) + arrays(((c, 4 * k), (k, 4 * k), (4 * k,)), F32, seed=1, scale=0.5)
    if carry:
        args += arrays(((n, k),), F32, seed=2) + arrays(((n, k),), dtype, seed=3)
    lengths = None if seq_lengths is None else jnp.asarray(seq_lengths)
    zeros = (jnp.zeros((n, k), F32), jnp.zeros((n, k), dtype))

    def ours(x, wi, wh, b, *c0h0):
        return jb.lstm(x, wi, wh, b, initial_carry=c0h0 or None, time_major=time_major, seq_lengths=lengths,
                       dtype=dtype, **kw)

    def theirs(x, wi, wh, b, *c0h0):
        return lstm_reference(lengths, time_major)(x, wi, wh, b, *(c0h0 or zeros))
    return ours, theirs, args


LSTM_CASES = {  # n, t, c, k, time_major, seq_lengths, initial carry
    "ones": (1, 1, 1, 1, False, None, True),
    "odd_seq_lengths": (3, 5, 7, 3, False, (5, 2, 1), True),
    "time_major_odd": (2, 3, 4, 5, True, None, True),
    "time_major_lengths_zero_carry": (4, 3, 2, 1, True, (1, 3, -1, 2), False),
}


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("case", list(LSTM_CASES))
def test_lstm_forward_mode(dtype, case):
    """jvp, linearize, jacfwd (every argument) and HVP (forward over reverse) equal the
    reference scan's; the tangent's program is the FC passes and the tangent pass, no scan."""
    n, t, c, k, time_major, seq_lengths, carry = LSTM_CASES[case]
    ours, theirs, args = lstm_case(dtype, n, t, c, k, time_major, seq_lengths, carry)
    tangents = tuple(tt.astype(a.dtype) for tt, a in zip(arrays([a.shape for a in args], F32, seed=6, scale=0.5),
                                                         args))
    tol, argnums = TOL[dtype], tuple(range(len(args)))
    jvp = lambda f: jax.jit(lambda a, tt: jax.jvp(f, a, tt))(args, tangents)  # noqa: E731
    got, want = jvp(ours), jvp(theirs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_close(g, w, tol)
    _, lin = jax.linearize(flat(ours), *args)
    assert_close(lin(*tangents), jax.jvp(flat(theirs), args, tangents)[1], tol)
    jac = lambda f: jax.jit(jax.jacfwd(flat(f), argnums))(*args)  # noqa: E731
    for g, w in zip(jac(ours), jac(theirs), strict=True):
        assert_close(g, w, tol)
    scalar = lambda f: lambda *a: jnp.sum(jnp.sin(flat(f)(*a)))  # noqa: E731
    hvp = lambda f: jax.jit(lambda a, tt: jax.jvp(jax.grad(scalar(f), argnums), a, tt)[1])  # noqa: E731
    for g, w in zip(hvp(ours)(args, tangents), hvp(theirs)(args, tangents), strict=True):
        assert_close(g, w, tol)

    calls, text = kernel_calls(lambda a, tt: jax.jvp(ours, a, tt), args, tangents)
    assert calls == {"jb_lstm_fwd": 1, "jb_fc_fwd": 2, "jb_lstm_tangent": 1}, calls
    assert "stablehlo.while" not in text
    calls, _ = kernel_calls(lambda a, tt: jax.jvp(jax.grad(scalar(ours), argnums), a, tt), args, tangents)
    assert calls["jb_lstm_tangent"] == 1, calls


def test_lstm_tangent_runs_only_the_passes_of_nonzero_tangents():
    """jvp in x alone: one FC pass (x's tangent by kernel_i); in the bias alone: none."""
    ours, theirs, args = lstm_case(F32, 3, 4, 5, 3)
    for arg, fc in ((0, 1), (2, 1), (3, 0)):
        f = lambda a, ta, arg=arg: jax.jvp(lambda v: ours(*args[:arg], v, *args[arg + 1:]), (a,), (ta,))  # noqa: E731
        g = lambda a, ta, arg=arg: jax.jvp(lambda v: theirs(*args[:arg], v, *args[arg + 1:]), (a,), (ta,))  # noqa: E731
        calls, _ = kernel_calls(f, args[arg], 0.5 * args[arg])
        assert calls.get("jb_fc_fwd", 0) == fc and calls["jb_lstm_tangent"] == 1, (arg, calls)
        for a, b in zip(jax.tree.leaves(jax.jit(f)(args[arg], 0.5 * args[arg])),
                        jax.tree.leaves(g(args[arg], 0.5 * args[arg])), strict=True):
            assert_close(a, b, 2e-4)


def test_lstm_forward_mode_equals_flax_rnn_selection():
    """Against stock flax itself: OptimizedLSTMCell in a scan, each row's carry selected by
    flax.linen.RNN's own _select_last_carry."""
    from flax.linen.recurrent import _select_last_carry
    from stock_reference import scan_lstm

    lengths = jnp.asarray([3, 1, 4, 2, 4])
    ours, _, args = lstm_case(F32, 5, 4, 3, 7, seq_lengths=lengths)

    def stock(x, wi, wh, b, c0, h0):
        carries = [scan_lstm(x[:, :s], wi, wh, b, c0, h0)[0] for s in range(1, x.shape[1] + 1)]
        stacked = tuple(jnp.stack([cc[i] for cc in carries]) for i in (0, 1))
        return _select_last_carry(stacked, lengths), scan_lstm(x, wi, wh, b, c0, h0)[1]

    tangents = tuple(0.5 * jnp.cos(a) for a in args)
    with jax.default_matmul_precision("highest"):
        want = jax.jvp(stock, args, tangents)
    for g, w in zip(jax.tree.leaves(jax.jit(lambda a, tt: jax.jvp(ours, a, tt))(args, tangents)),
                    jax.tree.leaves(want), strict=True):
        assert_close(g, w, 2e-4)


@pytest.mark.parametrize("time_major", [False, True])
def test_lstm_forward_mode_under_vmap(time_major):
    """vmap of jvp and jvp of vmap: shared weights fold into the mini-batch (one tangent call,
    no loop); mapped weights and a mapped bias tangent, per element."""
    ours, theirs, args = lstm_case(F32, 3, 4, 5, 3, time_major=time_major)
    xs = jnp.stack([args[0], 0.5 * args[0]])
    txs = jnp.stack([jnp.cos(args[0]), jnp.sin(args[0])])
    rest = args[1:]

    def per_x(f):
        return jax.vmap(lambda x, tx: jax.jvp(lambda v: f(v, *rest), (x,), (tx,))[1])

    def of_vmap(f):
        return lambda x, tx: jax.jvp(jax.vmap(lambda v: f(v, *rest)), (x,), (tx,))[1]

    for make in (per_x, of_vmap):
        got = jax.jit(make(ours))(xs, txs)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(make(theirs)(xs, txs)), strict=True):
            assert_close(g, w, 2e-4)
    calls, text = kernel_calls(per_x(ours), xs, txs)
    assert calls["jb_lstm_tangent"] == 1 and "stablehlo.while" not in text
    # two mapped axes, the inner one over the bias tangent (one per row once folded)
    nested = jax.vmap(jax.vmap(lambda x, tb: jax.jvp(lambda v, b: ours(v, rest[0], rest[1], b, *rest[3:]),
                                                     (x, rest[2]), (0.5 * x, tb))[1], (None, 0)), (0, None))
    stock = jax.vmap(jax.vmap(lambda x, tb: jax.jvp(lambda v, b: theirs(v, rest[0], rest[1], b, *rest[3:]),
                                                    (x, rest[2]), (0.5 * x, tb))[1], (None, 0)), (0, None))
    tbs = jnp.stack([jnp.cos(rest[2]), jnp.sin(rest[2]), rest[2]])
    for g, w in zip(jax.tree.leaves(jax.jit(nested)(xs, tbs)), jax.tree.leaves(stock(xs, tbs)), strict=True):
        assert_close(g, w, 2e-4)
    calls, text = kernel_calls(nested, xs, tbs)
    assert calls["jb_lstm_tangent"] == 1 and "stablehlo.while" not in text

    # mapped recurrent kernels (their tangents too) and a mapped bias tangent
    whs = jnp.stack([args[2], 0.7 * args[2]])
    tbs = jnp.stack([jnp.cos(args[3]), jnp.sin(args[3])])

    def mapped(f):
        def one(wh, twh, tb):
            a = (args[0], args[1], wh) + args[3:]
            t = (jnp.zeros_like(args[0]), jnp.zeros_like(args[1]), twh, tb) + tuple(0.5 * a for a in args[4:])
            return jax.jvp(f, a, t)[1]
        return jax.vmap(one)

    got = jax.jit(mapped(ours))(whs, 0.3 * whs, tbs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(mapped(theirs)(whs, 0.3 * whs, tbs)), strict=True):
        assert_close(g, w, 2e-4)
    got = jax.jit(jax.vmap(lambda tb: mapped(ours)(args[2][None], 0.3 * args[2][None], tb[None])))(tbs)
    want = jax.vmap(lambda tb: mapped(theirs)(args[2][None], 0.3 * args[2][None], tb[None]))(tbs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w, 2e-4)


def test_lstm_forward_mode_emulated_precision(monkeypatch):
    """precision= reaches the tangent's passes as it does the forward's: float32 from three
    bf16 products, close to exact float32; one product, bf16's accuracy."""
    monkeypatch.setattr(precision, "EMULATE", True)
    for name, products, tol in (("BF16_BF16_F32_X3", 3, 2e-4), ("BF16_BF16_F32", 1, 4e-2)):
        ours, theirs, args = lstm_case(F32, 3, 4, 5, 3, seq_lengths=(4, 1, 2), precision=name)
        tangents = tuple(0.5 * jnp.cos(a) for a in args)
        got = jax.jit(lambda a, tt: jax.jvp(ours, a, tt))(args, tangents)  # noqa: B023
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jvp(theirs, args, tangents)), strict=True):
            assert_close(g, w, tol)
        _, text = kernel_calls(lambda a, tt: jax.jvp(ours, a, tt), args, tangents)  # noqa: B023
        lines = [ln for ln in text.splitlines() if "custom_call @jb_lstm_tangent" in ln]
        # (and the exact one of exact_on_infinity's other branch, for infinite operands)
        assert any(f"products = {products}" in ln for ln in lines), lines


def test_lstm_grad_keeps_its_calls():
    """Reverse mode is the tangent's transpose, as before: bptt and two FC passes, no tangent
    pass, and no dx pass for an x nobody differentiates."""
    ours, _, args = lstm_case(F32, 3, 4, 5, 3, seq_lengths=(4, 1, 2))
    scalar = lambda *a: jnp.sum(jnp.sin(flat(ours)(*a)))  # noqa: E731
    calls, _ = kernel_calls(jax.grad(scalar, tuple(range(6))), *args)
    assert calls == {"jb_lstm_fwd": 1, "jb_lstm_bptt": 1, "jb_fc_bwd": 1, "jb_fc_upd": 1}
    calls, _ = kernel_calls(jax.grad(scalar, (1, 2, 3)), *args)
    assert calls == {"jb_lstm_fwd": 1, "jb_lstm_bptt": 1, "jb_fc_upd": 1}


@pytest.mark.slow  # a Hessian through the scan
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("seq_lengths", [None, (4, 2, 1)])
def test_lstm_hessian_and_reverse_over_forward(dtype, seq_lengths):
    ours, theirs, args = lstm_case(dtype, 3, 4, 5, 2, seq_lengths=seq_lengths)
    tangents = tuple(tt.astype(a.dtype) for tt, a in zip(arrays([a.shape for a in args], F32, seed=6, scale=0.5),
                                                         args))
    scalar = lambda f: lambda *a: jnp.sum(jnp.sin(flat(f)(*a)))  # noqa: E731
    tol = TOL[dtype]
    if dtype == F32:
        assert_close(jax.hessian(scalar(ours), 3)(*args), jax.hessian(scalar(theirs), 3)(*args), tol)

    def reverse_over_forward(f):
        tangent_loss = lambda *a: jnp.sum(jnp.sin(jax.jvp(flat(f), a, tangents)[1]))  # noqa: E731
        return jax.jit(jax.grad(tangent_loss, tuple(range(6))))(*args)

    for g, w in zip(reverse_over_forward(ours), reverse_over_forward(theirs), strict=True):
        assert_close(g, w, tol)
