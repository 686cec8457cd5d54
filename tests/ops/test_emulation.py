"""The bf16 emulation of float32 products (ops/emulation.py, JAX_BRGEMM_EMULATE=1): its
error against a float64 reference is within 16x of exact float32's with three products and
no worse with six (one product is bf16's), over reductions of 256 to 65,536 products, odd sizes,
zeros, subnormals and large magnitudes; its gradients are emulated to the same accuracy;
bfloat16 inputs and the default stay exact."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb
from jax_brgemm import precision
from jax_brgemm.ops import emulation

PRESET = {"float32": "highest", "bf16_3x": "BF16_BF16_F32_X3", "bf16_6x": "BF16_BF16_F32_X6",
          "bf16": "BF16_BF16_F32"}
# the emulation's error / exact float32's, at most (bf16: one product, ~2^-9 relative)
BOUND = {"bf16_3x": 16, "bf16_6x": 1}


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(precision, "EMULATE", True)


def emulating(hlo, products):
    """The custom calls of ``hlo`` asked for ``products`` emulated products."""
    return {line.split("@")[1].split("(")[0] for line in hlo.splitlines()
            if "custom_call @" in line and f"products = {products} : i64" in line}


def bf16_arrays(hlo):
    """The bfloat16 arrays ``hlo`` makes: none where the kernels split their operands."""
    return re.findall(r"tensor<[^>]*bf16>", hlo)


def rel_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def errors(a, b):
    """Each accuracy's jb.brgemm error against float64 (each traced afresh)."""
    ref = np.einsum("...bmk,...bkn->...mn", a.astype(np.float64), b.astype(np.float64))
    return {name: rel_error(jax.jit(lambda a, b, p=p: jb.brgemm(a, b, precision=p))(a, b), ref)
            for name, p in PRESET.items()}


def test_split_parts_sum_back_and_shrink():
    x = jnp.asarray(np.random.default_rng(0).standard_normal(1000), jnp.float32) * 1e3
    parts = emulation.split(x, 3)
    assert all(p.dtype == jnp.bfloat16 for p in parts)
    total = sum(p.astype(jnp.float32) for p in parts)
    assert float(jnp.max(jnp.abs(total - x) / jnp.abs(x))) < 2.0 ** -22
    for big, small in zip(parts, parts[1:]):
        assert bool(jnp.all(jnp.abs(small.astype(jnp.float32)) <= 2.0 ** -8 * jnp.abs(big.astype(jnp.float32))))


@pytest.mark.parametrize("batch,m,k,n", [(1, 8, 256, 16), (4, 5, 1024, 3), (2, 9, 32768, 7), (1, 3, 65536, 2), (1, 4, 262144, 3)])
def test_reductions_within_the_bounds(emulate, batch, m, k, n):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((batch, m, k)).astype(np.float32)
    b = rng.standard_normal((batch, k, n)).astype(np.float32)
    err = errors(a, b)
    for name, factor in BOUND.items():
        assert err[name] <= factor * err["float32"], err
    assert err["bf16"] < 2e-2, err  # one product: bf16's rounding, not float32's


def test_the_brgemm_kernel_splits_its_operands(emulate):
    """Both gradients' jb_brgemm calls (the forward's output is not used) are asked for the
    products, on the float32 operands themselves: no parts made in XLA."""
    a = np.ones((2, 3, 5, 7), np.float32)
    b = np.ones((3, 7, 4), np.float32)
    hlo = jax.jit(jax.grad(lambda a, b: jnp.sum(jb.brgemm(a, b, precision="high")), argnums=(0, 1))).lower(
        a, b).as_text()
    calls = [line for line in hlo.splitlines() if "@jb_brgemm" in line]  # (and exact_on_infinity's)
    assert sum("products = 3 : i64" in line for line in calls) == 2, calls
    assert not bf16_arrays(hlo)


@pytest.mark.parametrize("kind", ["zeros", "subnormals", "large", "mixed_scales"])
def test_hard_inputs(emulate, kind):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 7, 300)).astype(np.float32)
    b = rng.standard_normal((2, 300, 5)).astype(np.float32)
    if kind == "zeros":
        a[:, 3] = 0
        b[:, :, 1] = 0
    elif kind == "subnormals":  # some entries below float32's normal range, the rest normal
        a[:, :, ::7] = 1e-39
    elif kind == "large":
        a *= np.float32(1e18)
        b *= np.float32(1e17)
    else:
        a *= np.logspace(-6, 6, 300, dtype=np.float32)
    err = errors(a, b)
    assert np.isfinite(list(err.values())).all()
    for name, factor in BOUND.items():
        assert err[name] <= factor * max(err["float32"], 1e-7), err
    if kind == "zeros":
        y = jb.brgemm(a, b, precision="high")
        assert not np.any(np.asarray(y)[3]) and not np.any(np.asarray(y)[:, 1])


@pytest.mark.parametrize("accuracy", ["bf16", "bf16_3x", "bf16_6x"])
def test_dense_and_its_gradients_are_emulated(emulate, accuracy):
    rng = np.random.default_rng(2)
    # every reduction (forward, dx, dw) over at least 256 products, as the bounds are stated
    x = rng.standard_normal((259, 300)).astype(np.float32)
    w = (rng.standard_normal((300, 257)) / 20).astype(np.float32)
    b = rng.standard_normal(257).astype(np.float32)
    cot = rng.standard_normal((259, 257))
    f = jax.jit(lambda x, w, b: jb.dense(x, w, b, activation="tanh", precision=PRESET[accuracy]))
    grad = jax.grad(lambda *p: jnp.sum(f(*p) * cot), argnums=(0, 1, 2))
    # every pass splits its operands itself: the FC passes asked for the products
    hlo = jax.jit(grad).lower(x, w, b).as_text()
    products = f"products = {precision.PRODUCTS[accuracy]} : i64"
    for target in ("jb_fc_fwd", "jb_fc_bwd", "jb_fc_upd"):
        assert any(target in line and products in line for line in hlo.splitlines()), target
    assert "jb_brgemm" not in hlo
    y64 = np.tanh(x.astype(np.float64) @ w + b)
    dz = cot * (1 - y64 ** 2)
    want = (dz @ w.T, x.T.astype(np.float64) @ dz, dz.sum(0))
    got = (f(x, w, b),) + grad(x, w, b)
    exact = (jb.dense(x, w, b, activation="tanh"),) + jax.grad(
        lambda *p: jnp.sum(jb.dense(*p, activation="tanh") * cot), argnums=(0, 1, 2))(x, w, b)
    for g, e, ref in zip(got, exact, (y64,) + want, strict=True):
        if accuracy == "bf16":  # one product: bf16's rounding, not float32's
            assert 1e-5 < rel_error(g, ref) < 2e-2
        elif g.shape != b.shape:  # (db sums dz itself: exact whatever the accuracy)
            assert rel_error(g, ref) <= BOUND[accuracy] * max(rel_error(e, ref), 1e-7)


def test_grad_of_grad_of_the_emulated_brgemm(emulate):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 4, 6)).astype(np.float32)
    b = rng.standard_normal((2, 6, 3)).astype(np.float32)

    def outer(f):
        inner = jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), argnums=(0, 1))
        return jax.grad(lambda a, b: sum(jnp.sum(jnp.cos(g)) for g in inner(a, b)), argnums=(0, 1))

    got = outer(lambda a, b: jb.brgemm(a, b, precision="BF16_BF16_F32_X6"))(a, b)
    want = outer(lambda a, b: jnp.einsum("bmk,bkn->mn", a, b, precision="highest"))(a, b)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_and_the_default_stay_exact(emulate):
    rng = np.random.default_rng(4)
    a = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((1, 64, 5)), jnp.bfloat16)
    np.testing.assert_array_equal(jb.brgemm(a, b, precision="high"), jb.brgemm(a, b))
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    assert "jb_brgemm" in jax.jit(lambda a, b: jb.brgemm(a, b)).lower(a32, b32).as_text()
    # float32 parts of bf16-valued inputs are exact: every accuracy gives the exact product
    for p in PRESET.values():
        np.testing.assert_allclose(jb.brgemm(a32, b32, precision=p), jb.brgemm(a32, b32), rtol=1e-6, atol=1e-5)


def test_with_the_switch_off_every_request_is_exact_float32():
    assert precision.EMULATE is False  # the test run's (tests/conftest.py)
    a, x, w = jnp.ones((1, 3, 8)), jnp.ones((1, 5, 5, 8)), jnp.ones((3, 3, 8, 4))
    ops = [lambda: jb.brgemm(a, a.swapaxes(-1, -2), precision="high"),
           lambda: jb.dense(a[0], a[0].T, precision="high"),
           lambda: jb.conv2d(x, w, precision="high")]
    for op in ops:
        hlo = jax.jit(op).lower().as_text()
        assert "products = 0 : i64" in hlo and not emulating(hlo, 3) and not bf16_arrays(hlo)


def stock_conv(x, w, b, *, ldil=(1, 1), dil=(1, 1), groups=1, pads=((1, 1), (1, 1)), precision=None):
    """lax's convolution (+ bias, gelu) in the inputs' dtype, what jb.conv2d computes."""
    y = jax.lax.conv_general_dilated(x, w, (1, 1), pads, lhs_dilation=ldil, rhs_dilation=dil,
                                     feature_group_count=groups, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                     precision=precision)
    return jax.nn.gelu(y + b)  # the tanh form, as jb's (and flax's) gelu


def conv_and_grads(f, x, w, b, cot):
    return (f(x, w, b),) + jax.grad(lambda *p: jnp.sum(f(*p) * cot), argnums=(0, 1, 2))(x, w, b)


@pytest.mark.parametrize("accuracy", ["bf16_3x", "bf16_6x"])
def test_conv_and_its_gradients_are_emulated(emulate, accuracy):
    # every reduction over 288 products: forward 3x3x32, dx 3x3x32, dw 2x12x12
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 12, 12, 32)).astype(np.float32)
    w = (rng.standard_normal((3, 3, 32, 32)) / 17).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    cot = rng.standard_normal((2, 12, 12, 32)).astype(np.float32)
    conv = lambda p: lambda x, w, b: jb.conv2d(x, w, b, activation="gelu", precision=p)  # noqa: E731
    # every pass splits the float32 operands itself: no parts made in XLA
    hlo = jax.jit(lambda *a: conv_and_grads(conv(PRESET[accuracy]), *a, cot)).lower(x, w, b).as_text()
    assert emulating(hlo, len(emulation.TERMS[accuracy])) == {"jb_conv_fwd", "jb_conv_bwd", "jb_conv_upd"}
    assert not bf16_arrays(hlo)
    got = conv_and_grads(jax.jit(conv(PRESET[accuracy])), x, w, b, cot)
    exact = conv_and_grads(jax.jit(conv(None)), x, w, b, cot)
    stock = conv_and_grads(jax.jit(stock_conv), x, w, b, cot)
    with jax.enable_x64(True):
        want = conv_and_grads(stock_conv, *(a.astype(np.float64) for a in (x, w, b, cot)))
    # float32's error: ours, or stock's where its sums are longer (our dw sums in chunks)
    for g, e, st, ref in zip(got, exact, stock, want, strict=True):
        assert rel_error(g, ref) <= BOUND[accuracy] * max(rel_error(e, ref), rel_error(st, ref))


CONV_KINDS = {  # kind -> (x shape, kernel shape, stock_conv's geometry)
    "grouped": ((2, 9, 10, 12), (3, 3, 3, 8), dict(groups=4)),
    "depthwise": ((2, 9, 10, 6), (3, 3, 1, 6), dict(groups=6)),
    "dilated": ((1, 11, 9, 5), (3, 2, 5, 7), dict(dil=(2, 3), pads=((2, 2), (0, 3)))),
    "transposed": ((2, 5, 6, 4), (3, 3, 4, 3), dict(ldil=(2, 2), pads=((2, 2), (1, 2)))),
}


@pytest.mark.parametrize("kind", sorted(CONV_KINDS))
@pytest.mark.parametrize("accuracy", ["bf16", "bf16_3x", "bf16_6x"])
def test_every_conv_kind_is_emulated(emulate, kind, accuracy):
    """Grouped, depthwise, dilated and transposed convolutions, in the forward and both
    gradients: one bfloat16 product has bfloat16's error, three about
    2^-16's, six float32's (the stock float32 reference's own error is ~1e-6)."""
    xs, ws, geo = CONV_KINDS[kind]
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    b = rng.standard_normal(ws[-1]).astype(np.float32)
    f = jax.jit(lambda x, w, b: jb.conv2d(x, w, b, activation="gelu", padding=geo.get("pads", "SAME"),
                                          rhs_dilation=geo.get("dil", 1), lhs_dilation=geo.get("ldil", 1),
                                          feature_group_count=geo.get("groups", 1), precision=PRESET[accuracy]))
    cot = rng.standard_normal(f(x, w, b).shape).astype(np.float32)
    got = conv_and_grads(f, x, w, b, cot)
    want = conv_and_grads(lambda *p: stock_conv(*p, **geo, precision="highest"), x, w, b, cot)
    for g, ref in zip(got, want, strict=True):
        err = rel_error(g, ref)
        assert {"bf16": 1e-5 < err < 2e-2, "bf16_3x": err < 5e-5, "bf16_6x": err < 5e-6}[accuracy], err


def test_emulated_conv3d_and_vmap(emulate):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 1, 4, 5, 6, 8)).astype(np.float32)
    w = rng.standard_normal((2, 3, 3, 8, 4)).astype(np.float32)
    ours = jax.vmap(lambda x, w: jb.conv3d(x, w, precision="high"), in_axes=(0, None))
    stock = jax.vmap(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision="highest"),
        in_axes=(0, None))
    assert "jb_conv_fwd" in emulating(jax.jit(ours).lower(x, w).as_text(), 3)
    cot = rng.standard_normal(x.shape[:-1] + (4,)).astype(np.float32)
    for f in (lambda f: f, lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w) * cot), argnums=(0, 1))):
        for g, want in zip(jax.tree.leaves(f(ours)(x, w)), jax.tree.leaves(f(stock)(x, w)), strict=True):
            assert rel_error(g, want) < 3e-5


def test_a_stock_conv_layer_under_accelerate_follows_its_precision(emulate):
    """flax's Conv(precision=HIGH) under accelerate() runs the emulated passes; the same
    layer without a precision runs the exact float32 ones."""
    import flax.linen as nn

    x = np.random.default_rng(8).standard_normal((2, 8, 8, 16)).astype(np.float32)
    for prec, emulated in [("high", True), (None, False)]:
        layer = nn.Conv(16, (3, 3), feature_group_count=2, precision=prec)
        params = layer.init(jax.random.key(0), x)
        loss = lambda p: jnp.sum(jnp.sin(layer.apply(p, x)))  # noqa: E731
        with jb.accelerate():
            text = jax.jit(jax.grad(loss)).lower(params).as_text()
            grads = jax.grad(loss)(params)
        assert "jb_conv_upd" in text and ("jb_conv_upd" in emulating(text, 3)) == emulated
        want = jax.grad(loss)(params)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
            assert rel_error(g, w) < 5e-5


def attention_and_grads(f, q, k, v, cot):
    return (f(q, k, v),) + jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("accuracy", ["bf16", "bf16_3x", "bf16_6x"])
def test_attention_and_its_gradients_are_emulated(emulate, accuracy):
    """The kernel splits P and dS into parts where it makes them: over two key chunks (the
    online softmax's rescaling), two query blocks, grouped heads, a causal mask and a bias,
    one bfloat16 product has bfloat16's error, three about 2^-16's, six float32's (no worse than
    exact float32's, ours or stock XLA's)."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 70, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 600, 2, 16)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((4, 70, 600)).astype(np.float32)
    cot = rng.standard_normal(q.shape).astype(np.float32)
    ours = lambda p: jax.jit(lambda q, k, v: jb.dot_product_attention(  # noqa: E731
        q, k, v, bias, is_causal=True, precision=p))
    stock = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias, is_causal=True)  # noqa: E731
    assert f"products = {precision.PRODUCTS[accuracy]}" in ours(PRESET[accuracy]).lower(q, k, v).as_text()
    got = attention_and_grads(ours(PRESET[accuracy]), q, k, v, cot)
    exact = attention_and_grads(ours(None), q, k, v, cot)
    xla = attention_and_grads(jax.jit(stock), q, k, v, cot)
    with jax.enable_x64(True):
        want = attention_and_grads(stock, *(a.astype(np.float64) for a in (q, k, v, cot)))
    for g, e, x, ref in zip(got, exact, xla, want, strict=True):
        err, fp32 = rel_error(g, ref), max(rel_error(e, ref), rel_error(x, ref))
        assert {"bf16": 1e-4 < err < 2e-2, "bf16_3x": 2 * fp32 < err < 5e-5,
                "bf16_6x": err <= fp32}[accuracy], (err, fp32)


@pytest.mark.parametrize("accuracy", ["bf16", "bf16_3x", "bf16_6x"])
def test_lstm_and_its_gradients_are_emulated(emulate, accuracy):
    """The kernels split each step's h and gate gradient into parts where they make them
    (the input and weight gradients' passes split theirs as they re-block them): y and the
    gradients of x, both kernels and the bias through 13 steps, as for attention."""
    from jax_brgemm.ops.lstm import reference

    rng = np.random.default_rng(10)
    n, t, c, k = 20, 13, 163, 96  # every reduction (c + k, n * t) over 256 products, as the bounds are stated
    x = rng.standard_normal((n, t, c)).astype(np.float32)
    wi = (rng.standard_normal((c, 4 * k)) / np.sqrt(c)).astype(np.float32)
    wh = (rng.standard_normal((k, 4 * k)) / np.sqrt(k)).astype(np.float32)
    b = (rng.standard_normal(4 * k) / 10).astype(np.float32)
    cot = rng.standard_normal((n, t, k)).astype(np.float32)

    def with_grads(f, *args):
        loss = lambda *a: jnp.sum(f(*a)[1] * cot) + jnp.sum(f(*a)[0][0])  # noqa: E731
        return (f(*args)[1],) + jax.grad(loss, argnums=(0, 1, 2, 3))(*args)

    def stock(x, wi, wh, b):
        zeros = jnp.zeros((n, k), x.dtype)
        return reference(x, wi, wh, b, zeros, zeros, False)

    ours = lambda p: jax.jit(lambda *a: jb.lstm(*a, precision=p))  # noqa: E731
    assert f"products = {precision.PRODUCTS[accuracy]}" in ours(PRESET[accuracy]).lower(x, wi, wh, b).as_text()
    got = with_grads(ours(PRESET[accuracy]), x, wi, wh, b)
    exact = with_grads(ours(None), x, wi, wh, b)
    xla = with_grads(jax.jit(stock), x, wi, wh, b)
    with jax.enable_x64(True):
        want = with_grads(stock, *(a.astype(np.float64) for a in (x, wi, wh, b)))
    for g, e, xl, ref in zip(got, exact, xla, want, strict=True):
        err, fp32 = rel_error(g, ref), max(rel_error(e, ref), rel_error(xl, ref))
        assert {"bf16": 1e-4 < err < 2e-2, "bf16_3x": 2 * fp32 < err < 5e-5,
                "bf16_6x": err <= 1.1 * fp32}[accuracy], (err, fp32)  # both at fp32 rounding: 0.8-1.02x


@pytest.mark.parametrize("emulated", [False, True])
def test_the_report_says_what_each_precision_computed(monkeypatch, emulated):
    """accelerate(report=True) names the accuracy a layer asked and the one computed: the
    emulation where it is on, exact float32 otherwise and for bfloat16 computations; a layer
    without a precision says nothing."""
    import flax.linen as nn

    monkeypatch.setattr(precision, "EMULATE", emulated)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(8, (3,), precision="high")(x)
            x = nn.RNN(nn.OptimizedLSTMCell(8))(x)
            x = nn.MultiHeadDotProductAttention(2)(x)
            return nn.Dense(4)(x)

    x = jnp.ones((2, 5, 3))
    params = Model().init(jax.random.key(0), x)
    with jax.default_matmul_precision("BF16_BF16_F32_X6"):  # all but the Conv's
        with jb.accelerate() as acc:
            Model().apply(params, x)
    report = {c.layer: c.precision for c in acc.calls}
    assert all(c.accelerated for c in acc.calls), acc.summary()
    assert report["Conv"] == f"precision bf16_3x, computed {'bf16_3x' if emulated else 'float32'}"
    assert report["Dense"] == f"precision bf16_6x, computed {'bf16_6x' if emulated else 'float32'}"
    assert report["MultiHeadDotProductAttention"] == report["Dense"]
    assert report["RNN"] == report["Dense"]
    assert "computed" in acc.summary()
    with jb.accelerate() as acc:
        Model().apply(params, x)
    assert {c.layer: c.precision for c in acc.calls}["Dense"] == ""
    conv = nn.Conv(8, (3,), precision="high", dtype=jnp.bfloat16)  # bf16 products are exact
    with jb.accelerate() as acc:
        conv.apply(conv.init(jax.random.key(0), x), x)
    assert acc.calls[0].precision == "precision bf16_3x, computed float32"


def _with_infinities(rng, shape):
    a = rng.standard_normal(shape).astype(np.float32)
    flat = a.reshape(-1)
    flat[[3, 17, 21]] = np.inf, -np.inf, np.float32(3.4e38)  # the last's bf16 high part is inf
    return a


INFINITE_CASES = {
    "dense": lambda r: (lambda x, w, p: jb.dense(x, w, precision=p), (_with_infinities(r, (6, 40)),
                                                                        r.standard_normal((40, 7)))),
    "brgemm": lambda r: (lambda a, b, p: jb.brgemm(a, b, precision=p), (r.standard_normal((2, 5, 30)),
                                                                          _with_infinities(r, (2, 30, 4)))),
    "conv2d": lambda r: (lambda x, w, p: jb.conv2d(x, w, padding="SAME", precision=p),
                         (_with_infinities(r, (2, 6, 6, 8)), r.standard_normal((3, 3, 8, 5)))),
    "attention": lambda r: (lambda q, k, p: jb.dot_product_attention(q, k, k, precision=p),
                            (r.standard_normal((1, 9, 2, 8)), _with_infinities(r, (1, 11, 2, 8)))),
    "lstm": lambda r: (lambda x, wi, wh, p: jb.lstm(x, wi, wh, np.zeros(20, np.float32), precision=p)[1],
                       (_with_infinities(r, (3, 4, 40)), r.standard_normal((40, 20)) / 7,
                        r.standard_normal((5, 20)) / 3)),
}


@pytest.mark.parametrize("op", list(INFINITE_CASES))
def test_infinite_operands_propagate_as_in_float32(emulate, op):
    """An operand's infinity times another's low part (zero, or of the other sign) would be
    NaN: with one, the op computes exact float32 products instead (exact_on_infinity)."""
    f, args = INFINITE_CASES[op](np.random.default_rng(12))
    args = [np.asarray(a, np.float32) for a in args]
    exact = np.asarray(f(*args, None))
    assert np.isinf(exact).any() or op in ("attention", "lstm")  # (they saturate or mix)
    for p in ("BF16_BF16_F32_X3", "BF16_BF16_F32_X6", "BF16_BF16_F32"):
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda *a, p=p: f(*a, p))(*args)), exact)
    finite = [np.where(np.abs(a) > 1e38, 1.0, a).astype(np.float32) for a in args]  # and without, emulated
    assert not np.array_equal(np.asarray(f(*finite, "BF16_BF16_F32")), np.asarray(f(*finite, None)))


def test_under_vmap_only_the_items_with_an_infinity_are_exact(emulate):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((3, 10, 300)).astype(np.float32)
    w = rng.standard_normal((300, 7)).astype(np.float32)
    x[1, 2, 5] = np.inf
    f = lambda x, p: jb.dense(x, w, precision=p)  # noqa: E731
    got = np.asarray(jax.vmap(lambda x: f(x, "high"))(x))
    np.testing.assert_array_equal(got[1], np.asarray(f(x[1], None)))
    assert np.isinf(got[1, 2]).all()
    for i in (0, 2):  # emulated, as without vmap
        np.testing.assert_array_equal(got[i], np.asarray(f(x[i], "high")))
        assert not np.array_equal(got[i], np.asarray(f(x[i], None)))


def test_values_beyond_bfloat16s_range_are_exact(emulate):
    """3.4e38 is a finite float32 whose bfloat16 high part rounds to inf: its products stay
    finite, as in float32."""
    x = np.zeros((2, 8), np.float32)
    x[0, 0], x[1, 1] = 3.4e38, 1.0
    w = np.full((8, 3), 0.25, np.float32)
    for p in ("high", "BF16_BF16_F32_X6", "BF16_BF16_F32"):
        np.testing.assert_array_equal(jb.dense(x, w, precision=p), jb.dense(x, w))
    assert np.isfinite(np.asarray(jb.dense(x, w))).all()
