"""jb.conv2d and jb.nn.Conv against flax.linen.Conv / lax.conv_general_dilated: outputs and
gradients (jax.grad of the stock layer with the same parameters) over kernel sizes, strides,
every padding form, odd sizes, small and odd channel counts, bias, activations, bf16,
batch dims, vmap, jit, empty batches and bad input."""

import re

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_brgemm as jb
from jax_brgemm.nn.conv import conv_on_kernels
from stock_reference import conv_general_dilated as exact_conv

HI = jax.lax.Precision.HIGHEST
REF_ACT = {None: lambda v: v, "relu": jax.nn.relu, "gelu": jax.nn.gelu,
           "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}


def stock(features, kernel_size, activation=None, **kw):
    """flax.linen.Conv followed by the activation: what jb.nn.Conv must equal."""
    conv = fnn.Conv(features, kernel_size, precision=HI, conv_general_dilated=exact_conv, **kw)
    return lambda p, x: REF_ACT[activation](conv.apply(p, x)), conv


def loss(apply, p, x, seed=3):
    """A scalar with a non-trivial cotangent for every output element."""
    y = apply(p, x)
    w = np.random.default_rng(seed).standard_normal(y.shape).astype(np.float32)
    return jnp.sum(y.astype(jnp.float32) * w)


def check_layer(shape, features, kernel_size, activation=None, dtype=None, tol=2e-4, seed=0, grads=True,
                **kw):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    ref_apply, ref = stock(features, kernel_size, activation, dtype=dtype, **kw)
    layer = jb.nn.Conv(features, kernel_size, activation=activation, dtype=dtype, **kw)
    # the same variable tree (shapes and dtypes, traced only: eager initializers are slow),
    # filled with random values (non-zero biases, so that they matter)
    tree = jax.eval_shape(ref.init, jax.random.key(seed), x)
    assert jax.eval_shape(layer.init, jax.random.key(seed), x) == tree
    params = jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape) / np.sqrt(np.prod(a.shape[:-1]) if a.ndim > 1 else 4),
                              a.dtype), tree)
    jb_apply = layer.apply
    y, y_ref = jax.jit(jb_apply)(params, x), jax.jit(ref_apply)(params, x)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    scale = 1 + float(jnp.max(jnp.abs(y_ref.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), atol=tol * scale, rtol=tol)
    if not grads:
        return
    g = jax.jit(jax.grad(lambda p, x: loss(jb_apply, p, x), argnums=(0, 1)))(params, x)
    g_ref = jax.jit(jax.grad(lambda p, x: loss(ref_apply, p, x), argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref),
                    strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        s = 1 + float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol * s, rtol=tol)


# (input shape, features, kernel size, strides, padding)
CASES = [
    ((2, 9, 11, 3), 8, (3, 3), 1, "SAME"),             # a stem-like C = 3, odd sizes
    ((2, 15, 13, 1), 5, (7, 7), 2, "SAME"),            # 7x7 stride 2, C = 1
    ((2, 7, 9, 13), 70, (1, 1), 1, "VALID"),           # pointwise, channels of no block size
    ((2, 9, 8, 16), 33, (1, 1), 2, "SAME"),            # 1x1 stride 2
    ((1, 10, 12, 5), 9, (3, 2), (2, 1), ((0, 1), (2, 0))),  # non-square, mixed strides
    ((2, 8, 8, 40), 72, (3, 3), 2, "SAME"),            # SAME stride 2 on an even input
    ((1, 6, 7, 3), 6, (5, 5), 1, 6),                   # padding larger than the filter
    ((1, 7, 8, 2), 3, (1, 1), 3, "VALID"),             # stride > filter
    ((1, 5, 6, 4), 6, (3, 3), 1, [1, (0, 2)]),         # Flax's mixed per-dim form
    ((1, 30, 29, 24), 20, (3, 3), 1, "SAME"),          # a larger image: borders in place
    ((2, 11, 12, 6), 10, (2, 4), (3, 2), "VALID"),
]


@pytest.mark.parametrize("shape,features,kernel_size,strides,padding", CASES)
def test_matches_flax(shape, features, kernel_size, strides, padding):
    check_layer(shape, features, kernel_size, strides=strides, padding=padding)


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
def test_activations(activation):
    check_layer((2, 8, 9, 5), 12, (3, 3), activation=activation, strides=1, padding="SAME")


def test_no_bias_and_param_tree():
    x = jnp.ones((1, 6, 6, 3))
    for kw in (dict(use_bias=False), dict(use_bias=True, param_dtype=jnp.bfloat16)):
        a = jb.nn.Conv(4, (3, 3), **kw).init(jax.random.key(0), x)
        b = fnn.Conv(4, (3, 3), **kw).init(jax.random.key(0), x)
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
            assert u.dtype == v.dtype
            np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
    check_layer((2, 7, 7, 3), 8, (3, 3), use_bias=False, activation="relu")


def test_bf16():
    check_layer((2, 9, 10, 6), 20, (3, 3), dtype=jnp.bfloat16, tol=5e-2, strides=2, padding="SAME")
    check_layer((2, 8, 8, 16), 24, (1, 1), dtype=jnp.bfloat16, tol=5e-2)
    # relu in bf16: outputs only (where z rounds to the other side of 0, the two masks differ)
    check_layer((2, 8, 8, 16), 24, (3, 3), dtype=jnp.bfloat16, tol=5e-2, activation="relu", grads=False)


@pytest.mark.parametrize("padding", ["CIRCULAR", "REFLECT"])
def test_circular_and_reflect(padding):
    check_layer((1, 7, 8, 3), 4, (3, 3), padding=padding)


def test_1d_and_causal():
    check_layer((2, 11, 3), 5, 3, padding="SAME")
    check_layer((2, 11, 3), 5, (4,), padding="CAUSAL", strides=2)


def test_batch_dims():
    check_layer((2, 3, 6, 7, 3), 4, (3, 3))  # two batch dims, flattened and restored
    check_layer((6, 7, 3), 4, (3, 3))        # unbatched


def test_conv2d_against_lax_and_jit():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 9, 9, 4)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 3, 4, 5)), jnp.float32)
    ref = jax.lax.conv_general_dilated(x, k, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                       precision=HI)
    y = jax.jit(lambda x, k: jb.conv2d(x, k, strides=2))(x, k)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_vmap():
    rng = np.random.default_rng(2)
    xs = jnp.asarray(rng.standard_normal((3, 2, 7, 6, 4)), jnp.float32)
    ks = jnp.asarray(rng.standard_normal((3, 3, 3, 4, 5)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((5,)), jnp.float32)
    f = lambda x, k: jb.conv2d(x, k, b, padding=1, activation="relu")
    want = jnp.stack([f(xs[i], ks[0]) for i in range(3)])
    np.testing.assert_allclose(jax.vmap(f, (0, None))(xs, ks[0]), want, rtol=1e-5, atol=1e-5)
    want = jnp.stack([f(xs[i], ks[i]) for i in range(3)])
    np.testing.assert_allclose(jax.vmap(f)(xs, ks), want, rtol=1e-5, atol=1e-5)
    g = jax.vmap(jax.grad(lambda x, k: jnp.sum(f(x, k) ** 2), argnums=1))(xs, ks)
    g_want = jnp.stack([jax.grad(lambda x, k: jnp.sum(f(x, k) ** 2), argnums=1)(xs[i], ks[i]) for i in range(3)])
    np.testing.assert_allclose(g, g_want, rtol=1e-4, atol=1e-4)


def test_empty_batch():
    x = jnp.zeros((0, 5, 5, 3))
    k = jnp.ones((3, 3, 3, 4))
    assert jb.conv2d(x, k, strides=2).shape == (0, 3, 3, 4)
    g = jax.grad(lambda k: jnp.sum(jb.conv2d(x, k)))(k)
    assert g.shape == k.shape and not np.any(np.asarray(g))


def test_nan_propagates():
    x = jnp.ones((1, 5, 5, 2)).at[0, 0, 0, 1].set(jnp.nan)
    y = np.asarray(jb.conv2d(x, jnp.ones((3, 3, 2, 3))))
    assert np.isnan(y[0, :2, :2]).all() and not np.isnan(y[0, 3:]).any()


def test_bad_input():
    x, k = jnp.ones((1, 5, 5, 3)), jnp.ones((3, 3, 3, 4))
    with pytest.raises(ValueError, match="NHWC"):
        jb.conv2d(jnp.ones((5, 5, 3)), k)
    with pytest.raises(ValueError, match="HWIO"):
        jb.conv2d(x, jnp.ones((3, 3, 4)))
    with pytest.raises(ValueError, match="channels"):
        jb.conv2d(x, jnp.ones((3, 3, 2, 4)))
    with pytest.raises(ValueError, match="grouped"):
        jb.conv2d(jnp.ones((1, 5, 5, 6)), k)
    with pytest.raises(ValueError, match="strides must be >= 1"):
        jb.conv2d(x, k, strides=0)
    with pytest.raises(ValueError, match="strides must be >= 1"):
        jb.conv2d(x, k, strides=(1, -2))
    with pytest.raises(TypeError, match="strides must be an int or a pair of ints"):
        jb.conv2d(x, k, strides=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        jb.conv2d(x, k, padding=((1, -1), (0, 0)))
    with pytest.raises(ValueError, match="invalid padding"):
        jb.conv2d(x, k, padding=((1, 1, 1), (0, 0)))
    with pytest.raises(ValueError, match="flax.linen.Conv"):
        jb.conv2d(x, k, padding="CIRCULAR")
    with pytest.raises(ValueError, match="bias"):
        jb.conv2d(x, k, jnp.ones((3,)))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        jb.conv2d(x.astype(jnp.float16), k)
    with pytest.raises(ValueError, match="unknown activation"):
        jb.conv2d(x, k, activation="swish")
    with pytest.raises(ValueError, match="rank"):
        jb.nn.Conv(3, (3, 3)).init(jax.random.key(0), jnp.ones((5, 3)))


def kernel_calls(apply, *args):
    """The jax_brgemm custom calls in the lowered program of ``apply(*args)``."""
    return re.findall(r"custom_call @(jb_\w+)", jax.jit(apply).lower(*args).as_text())


@pytest.mark.parametrize("shape,features,kernel_size,kw,reason", [
    ((1, 3, 3, 3, 3, 2), 3, (2, 2, 2, 2), {}, "4-D convolution"),
])
def test_stock_fallback(shape, features, kernel_size, kw, reason):
    """What the kernels do not run computes as flax.linen.Conv does, with the same params,
    and without a single kernel call."""
    check_layer(shape, features, kernel_size, **kw)
    x = jnp.ones(shape)
    layer = jb.nn.Conv(features, kernel_size, **kw)
    params = layer.init(jax.random.key(0), x)
    assert kernel_calls(layer.apply, params, x) == []
    assert conv_on_kernels(layer, x, params["params"]["kernel"], params["params"]["bias"]) == (
        None, reason)
    if len(kernel_size) == 2 and kw.get("feature_group_count", 1) == 1:
        # the same layer without what it falls back for runs on the kernels: the check can fail
        supported = jb.nn.Conv(features, kernel_size)
        assert kernel_calls(supported.apply, params, x) == ["jb_conv_fwd"]


@pytest.mark.parametrize("padding", [((-1, 1), (0, 0)), ((2, -3), (-1, -2)), -1])
def test_negative_padding_crops(padding):
    """A negative pad crops the input (the kernels run the rest)."""
    x = jax.random.normal(jax.random.key(0), (2, 9, 10, 3))
    layer = jb.nn.Conv(4, (3, 3), padding=padding)
    params = layer.init(jax.random.key(1), x)
    assert "jb_conv" in jax.jit(layer.apply).lower(params, x).as_text()  # on the kernels
    check_against_exact_stock(layer, params, x, padding)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("shape,kernel_size,padding", [
    ((2, 11, 4), (3,), [(3, 1)]), ((2, 11, 4), (3,), [(1, 5)]), ((3, 1, 11, 4), (1, 3), ((0, 0), (5, 0))),
    ((2, 7, 1, 4), (3, 1), ((4, 2), (0, 0))), ((2, 5, 7, 4), (3, 3), ((3, 4), (4, 3)))])
def test_pads_beyond_the_filters_reach(shape, kernel_size, padding, dtype):
    """Pads wider than the filter reaches: output pixels of padding alone, and a negative pad
    in the input gradient's dual convolution. Stock XLA's own input gradient is wrong here
    (it reads the next image: stock_reference.conv_general_dilated); ours is exact."""
    x = jax.random.normal(jax.random.key(0), shape)
    layer = jb.nn.Conv(3, kernel_size, padding=padding, dtype=dtype)
    params = layer.init(jax.random.key(1), x)
    assert "jb_conv_bwd" in jax.jit(jax.grad(lambda x: jnp.sum(layer.apply(params, x)))).lower(x).as_text()
    check_against_exact_stock(layer, params, x, padding, dtype, 5e-2 if dtype else 1e-4)


def check_against_exact_stock(layer, params, x, padding, dtype=None, tol=1e-4):
    """layer's outputs and gradients equal flax's Conv with padding done by lax.pad."""
    ref = fnn.Conv(layer.features, layer.kernel_size, padding=padding, dtype=dtype, precision=HI,
                   conv_general_dilated=exact_conv)
    loss = lambda f: lambda p, x: jnp.sum(jnp.tanh(f(p, x).astype(jnp.float32)))  # noqa: E731
    np.testing.assert_allclose(*(np.asarray(f(params, x), np.float32) for f in (jax.jit(layer.apply), ref.apply)),
                               atol=tol, rtol=tol)
    g, g_ref = (jax.grad(loss(f), argnums=(0, 1))(params, x) for f in (layer.apply, ref.apply))
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(h=st.integers(1, 9), w=st.integers(1, 9), c=st.sampled_from([1, 3, 5, 17]),
       k=st.sampled_from([1, 4, 19, 40]), r=st.integers(1, 4), s=st.integers(1, 4),
       sh=st.integers(1, 3), sw=st.integers(1, 3), pad=st.sampled_from(["SAME", "VALID", 1, ((2, 0), (0, 3))]),
       bf16=st.booleans())
def test_hypothesis_shapes(h, w, c, k, r, s, sh, sw, pad, bf16):
    if pad == "VALID" and (r > h or s > w):
        return
    if isinstance(pad, tuple) and (h + 2 < r or w + 3 < s):
        return
    check_layer((2, h, w, c), k, (r, s), strides=(sh, sw), padding=pad,
                dtype=jnp.bfloat16 if bf16 else None, tol=5e-2 if bf16 else 2e-4)


@pytest.mark.parametrize("activation,strides,padding", [(None, (2, 2), "SAME"), ("relu", (1, 2), ((1, 0), (2, 1))),
                                                         ("gelu", (1, 1), "VALID")])
def test_grad_of_grad(activation, strides, padding):
    """jax.grad(jax.grad(...)) through jb.conv2d matches the stock convolution's (fp32)."""
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (2, 7, 6, 3))
    w = 0.3 * jax.random.normal(keys[1], (3, 3, 3, 5))
    b = 0.1 * jax.random.normal(keys[2], (5,))
    act = {None: lambda v: v, "relu": jax.nn.relu, "gelu": lambda v: jax.nn.gelu(v, approximate=True)}[activation]

    def stock_conv(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return act(y + b)

    def fast_conv(x, w, b):
        return jb.conv2d(x, w, b, strides=strides, padding=padding, activation=activation)

    def outer(conv):
        inner = jax.grad(lambda x, w, b: jnp.sum(jnp.sin(conv(x, w, b))), argnums=(0, 1, 2))
        return jax.grad(lambda x, w, b: sum(jnp.sum(jnp.cos(g)) for g in inner(x, w, b)), argnums=(0, 1, 2))

    want = outer(stock_conv)(x, w, b)
    got = jax.jit(outer(fast_conv))(x, w, b)
    for a, e in zip(got, want, strict=True):
        np.testing.assert_allclose(a, e, rtol=2e-4, atol=2e-4)


def accelerated(module):
    def apply(*args):
        with jb.accelerate():
            return module.apply(*args)
    return apply


@pytest.mark.parametrize("shape,kernel_size,strides,padding", [
    ((2, 2, 2, 3), (3, 3), 1, "VALID"),      # a kernel larger than the input
    ((2, 4, 2, 3), (3, 3), (2, 1), "VALID"),  # larger in one dim only
    ((2, 0, 5, 3), (3, 3), 1, "SAME"),       # H = 0
    ((2, 5, 0, 3), (1, 1), 2, "VALID"),      # W = 0
    ((0, 1, 1, 3), (3, 3), 1, "VALID"),      # N = 0 and an empty output
    ((1, 3, 3, 3), (5, 2), 1, ((0, 1), (0, 0))),  # padded, still too small
])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_empty_output_is_the_stock_empty_result(shape, kernel_size, strides, padding, activation):
    """Stock gives an empty result (and zero gradients) where the output has no pixels:
    jb.conv2d, jb.nn.Conv and a stock nn.Conv inside accelerate() give the same."""
    x = jnp.ones(shape)
    ref_apply, ref = stock(4, kernel_size, activation, strides=strides, padding=padding)
    params = ref.init(jax.random.key(0), jnp.ones((1, 9, 9, 3)))
    params = jax.tree_util.tree_map(lambda v: v + 0.5, params)
    ours = jb.nn.Conv(4, kernel_size, strides=strides, padding=padding, activation=activation)

    def op(p, x):
        return jb.conv2d(x, p["params"]["kernel"], p["params"]["bias"], strides=strides, padding=padding,
                         activation=activation)

    acc = accelerated(ref)
    want = ref_apply(params, x)
    assert 0 in want.shape
    grad = jax.grad(lambda p, x, f: loss(f, p, x), argnums=(0, 1))
    for f in (op, ours.apply, lambda p, x: REF_ACT[activation](acc(p, x))):
        y = f(params, x)
        assert y.shape == want.shape and y.dtype == want.dtype
        got, expected = grad(params, x, f), grad(params, x, ref_apply)
        for a, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected), strict=True):
            assert a.shape == e.shape and a.dtype == e.dtype
            np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("strides", [(1.5, 1.5), (2.0, 2.0), (1, 1.5), 1.5, (np.float32(2), 1)])
def test_non_integer_strides_are_a_type_error(strides):
    """lax and Flax refuse non-integer strides with a TypeError; so do jb.conv2d,
    jb.nn.Conv and an accelerated nn.Conv (never a truncation to the int part)."""
    x, k = jnp.ones((1, 5, 5, 3)), jnp.ones((3, 3, 3, 4))
    with pytest.raises(TypeError, match="strides"):
        jb.conv2d(x, k, strides=strides)
    with pytest.raises(TypeError):
        fnn.Conv(4, (3, 3), strides=strides).init(jax.random.key(0), x)
    with pytest.raises(TypeError):
        jb.nn.Conv(4, (3, 3), strides=strides).init(jax.random.key(0), x)
    params = fnn.Conv(4, (3, 3)).init(jax.random.key(0), x)
    with pytest.raises(TypeError):
        accelerated(fnn.Conv(4, (3, 3), strides=strides))(params, x)


def test_integer_like_strides_are_taken():
    x, k = jnp.ones((1, 5, 5, 3)), jnp.ones((3, 3, 3, 4))
    want = jb.conv2d(x, k, strides=(2, 1))
    np.testing.assert_array_equal(jb.conv2d(x, k, strides=(np.int64(2), np.int32(1))), want)
    np.testing.assert_array_equal(jb.conv2d(x, k, strides=np.array([2, 1])), want)


@pytest.mark.parametrize("shape,padding", [((1, 0, 0, 2), 1), ((2, 0, 3, 2), ((2, 1), (0, 0)))])
def test_empty_input_with_padding_is_all_padding(shape, padding):
    """No input pixels, but padding: stock gives output pixels that see only padding (the
    bias, through the activation); the kernels refuse H or W = 0, XLA computes it."""
    x, k, b = jnp.ones(shape), jnp.ones((1, 1, 2, 3)), jnp.arange(3.0)
    want = jax.nn.sigmoid(jax.lax.conv_general_dilated(
        x, k, (1, 1), ((padding, padding),) * 2 if isinstance(padding, int) else padding,
        dimension_numbers=("NHWC", "HWIO", "NHWC")) + b)
    got = jb.conv2d(x, k, b, padding=padding, activation="sigmoid")
    assert got.shape == want.shape and got.size > 0
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_module_stock_path_crops_negative_padding():
    """jb.nn.Conv's stock path (a dtype the kernels do not take) crops negative pads as the
    kernel path does, rather than XLA's cropping convolution (which reads garbage now and
    then); the result is the cropped input's stock convolution."""
    x = jax.random.normal(jax.random.key(0), (2, 6, 5, 3))
    layer = jb.nn.Conv(4, (3, 3), padding=((-1, 2), (1, -2)), dtype=jnp.float16)
    params = layer.init(jax.random.key(1), x)
    hlo = jax.jit(layer.apply).lower(params, x).as_text()
    assert "jb_conv" not in hlo and "pad = [[0, 2], [1, 0]]" in hlo
    cropped = fnn.Conv(4, (3, 3), padding=((0, 2), (1, 0)), dtype=jnp.float16)
    np.testing.assert_array_equal(jax.jit(layer.apply)(params, x), jax.jit(cropped.apply)(params, x[:, 1:, :-2]))


@pytest.mark.parametrize("products,dtype,match", [(2, jnp.float32, "products = 2; 0"),
                                                  (-1, jnp.float32, "products = -1; 0"),
                                                  (3, jnp.bfloat16, "take float32")])
@pytest.mark.parametrize("target", ["jb_conv_fwd", "jb_conv_bwd", "jb_conv_upd"])
def test_ffi_handlers_refuse_products_they_cannot_compute(target, products, dtype, match):
    """Called directly, a products count the kernels do not have, or emulated products of
    bf16 operands, is an error naming it, not a crash or a silent exact result."""
    x, w, dz = jnp.ones((1, 5, 5, 4), dtype), jnp.ones((3, 3, 4, 6), dtype), jnp.ones((1, 5, 5, 6), dtype)
    geometry = {k: np.int64(v) for k, v in dict(sh=1, sw=1, pt=1, pb=1, pl=1, pr=1, dh=1, dw=1, g=1).items()}
    out = {"jb_conv_fwd": [(dz.shape, dtype), ((0,), dtype)], "jb_conv_bwd": [(x.shape, dtype)],
           "jb_conv_upd": [(w.shape, jnp.float32), ((0,), jnp.float32)]}[target]
    args = {"jb_conv_fwd": (x, w, jnp.zeros((0,), jnp.float32)), "jb_conv_bwd": (dz, w), "jb_conv_upd": (x, dz)}[target]
    extra = {"act": np.int32(0)} if target == "jb_conv_fwd" else {}
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in out]
    call = jax.ffi.ffi_call(target, structs if len(structs) > 1 else structs[0])
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(*args, **extra, **geometry, products=np.int64(products)))
