"""jb.nn.Dense against flax.linen.Dense: identical parameters, stock checkpoints load,
same outputs and gradients, dtype / param_dtype semantics."""

import dataclasses

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import jax_brgemm as jb

FLAX_ACT = {None: lambda v: v, "relu": fnn.relu, "gelu": fnn.gelu, "sigmoid": fnn.sigmoid,
            "tanh": jnp.tanh}


def inputs(shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def stock(features, activation=None, **kw):
    """flax.linen.Dense followed by the activation: what jb.nn.Dense replaces."""
    class Stock(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return FLAX_ACT[activation](fnn.Dense(features, name="inner", **kw)(x))
    return Stock()


def apply_stock(features, activation, params, x, **kw):
    return stock(features, activation, **kw).apply({"params": {"inner": params["params"]}}, x)


def assert_close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("kw", [{}, {"use_bias": False}, {"param_dtype": jnp.bfloat16},
                                {"dtype": jnp.bfloat16},
                                {"kernel_init": fnn.initializers.normal(0.3),
                                 "bias_init": fnn.initializers.constant(0.1)}])
def test_parameters_equal_flax(kw):
    x = inputs((4, 7))
    key = jax.random.key(42)
    ours = jb.nn.Dense(5, activation="relu", **kw).init(key, x)
    theirs = fnn.Dense(5, **kw).init(key, x)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "sigmoid", "tanh"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_outputs_and_grads_match_flax(activation, use_bias):
    x = inputs((3, 11, 40))
    params = fnn.Dense(70, use_bias=use_bias).init(jax.random.key(1), x)  # a stock checkpoint
    ours = jb.nn.Dense(70, use_bias=use_bias, activation=activation)

    def loss(apply):
        return lambda p, x: jnp.sum(jnp.cos(apply(p, x)) * jnp.arange(70.0) / 70)

    f_ours = lambda p, x: ours.apply(p, x)
    f_theirs = lambda p, x: apply_stock(70, activation, p, x, use_bias=use_bias)
    assert_close(jax.jit(f_ours)(params, x), f_theirs(params, x), 1e-5)
    g = jax.jit(jax.grad(loss(f_ours), (0, 1)))(params, x)
    r = jax.grad(loss(f_theirs), (0, 1))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(r), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, 1e-5)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_bf16_compute_fp32_params(activation):
    """dtype=bf16, param_dtype=f32 (Flax's mixed precision): bf16 activations, fp32 params
    and fp32 parameter gradients, values within bf16 rounding of Flax's."""
    x = inputs((64, 96))
    layer = jb.nn.Dense(48, activation=activation, dtype=jnp.bfloat16)
    params = layer.init(jax.random.key(0), x)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
    y = jax.jit(layer.apply)(params, x)
    want = apply_stock(48, activation, params, x, dtype=jnp.bfloat16)
    assert y.dtype == want.dtype == jnp.bfloat16
    assert_close(y, want, 2e-2)
    loss = lambda apply: (lambda p, x: jnp.sum(apply(p, x).astype(jnp.float32) ** 2))
    g = jax.jit(jax.grad(loss(layer.apply), (0, 1)))(params, x)
    r = jax.grad(loss(lambda p, x: apply_stock(48, activation, p, x, dtype=jnp.bfloat16)), (0, 1))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(r), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, 5e-2)


def test_dtype_promotion_like_flax():
    x = inputs((2, 6))
    for kw in [{}, {"param_dtype": jnp.bfloat16}, {"dtype": jnp.bfloat16},
               {"param_dtype": jnp.bfloat16, "dtype": jnp.float32}]:
        for xin in (x, x.astype(jnp.bfloat16)):
            ours = jb.nn.Dense(3, **kw)
            params = ours.init(jax.random.key(0), xin)
            assert ours.apply(params, xin).dtype == fnn.Dense(3, **kw).apply(params, xin).dtype, kw
    # integer inputs are promoted to float, as in flax
    ints = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    params = jb.nn.Dense(3).init(jax.random.key(0), ints)
    assert_close(jb.nn.Dense(3).apply(params, ints), fnn.Dense(3).apply(params, ints), 1e-5)


def test_stock_checkpoint_loads_unchanged():
    """A serialized flax.linen model restores into the jb twin and computes the same."""
    class Net(fnn.Module):
        dense: type = fnn.Dense

        @fnn.compact
        def __call__(self, x):
            x = fnn.relu(self.dense(32)(x)) if self.dense is fnn.Dense else self.dense(32, activation="relu")(x)
            return self.dense(4)(x)

    x = inputs((5, 12))
    stock_params = Net().init(jax.random.key(3), x)
    blob = serialization.to_bytes(stock_params)
    template = Net(dense=jb.nn.Dense).init(jax.random.key(9), x)
    restored = serialization.from_bytes(template, blob)
    assert_close(Net(dense=jb.nn.Dense).apply(restored, x), Net().apply(stock_params, x), 1e-5)


def test_unknown_activation():
    with pytest.raises(ValueError, match="unknown activation"):
        jb.nn.Dense(3, activation="swish").init(jax.random.key(0), jnp.ones((1, 2)))


# --- a drop-in for flax.linen.Dense ------------------------------------------------------------

def test_stock_fields_in_stock_order_then_ours():
    stock_fields = [f.name for f in dataclasses.fields(fnn.Dense) if f.name not in ("parent", "name")]
    ours = [f.name for f in dataclasses.fields(jb.nn.Dense) if f.name not in ("parent", "name")]
    assert ours[:len(stock_fields)] == stock_fields
    assert ours[len(stock_fields):] == ["activation"]


def test_positional_construction_as_in_flax():
    x = inputs((3, 5))
    ours, theirs = jb.nn.Dense(4, True, jnp.bfloat16), fnn.Dense(4, True, jnp.bfloat16)
    assert ours.dtype == jnp.bfloat16 and ours.activation is None
    params = theirs.init(jax.random.key(0), x)
    y = ours.apply(params, x)
    assert y.dtype == jnp.bfloat16
    assert_close(y, theirs.apply(params, x), 2e-2)
    assert jb.nn.Dense(4, False).init(jax.random.key(0), x)["params"].keys() == {"kernel"}


def on_kernels(layer, params, x):
    """Whether the layer's jitted apply calls the FC kernel."""
    return "jb_fc_fwd" in jax.jit(layer.apply).lower(params, x).as_text()


@pytest.mark.parametrize("dtype,param_dtype,x_dtype", [(jnp.float16, jnp.float32, jnp.float32),
                                                       (None, jnp.float16, jnp.float16)])
def test_other_dtypes_compute_as_stock(dtype, param_dtype, x_dtype):
    x = inputs((3, 6), dtype=x_dtype)
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    ours, theirs = jb.nn.Dense(5, **kw), fnn.Dense(5, **kw)
    params = theirs.init(jax.random.key(0), x)
    assert not on_kernels(ours, params, x)
    y, want = ours.apply(params, x), theirs.apply(params, x)
    assert y.dtype == want.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    # with the activation applied after the stock computation
    y = jb.nn.Dense(5, activation="tanh", **kw).apply(params, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.tanh(want)))


def test_float16_params_with_float32_inputs_run_on_the_kernels():
    """They promote to float32 (as in flax), a dtype the kernels take."""
    x = inputs((3, 6))
    ours, theirs = jb.nn.Dense(5, param_dtype=jnp.float16), fnn.Dense(5, param_dtype=jnp.float16)
    params = theirs.init(jax.random.key(0), x)
    assert on_kernels(ours, params, x)
    y, want = ours.apply(params, x), theirs.apply(params, x)
    assert y.dtype == want.dtype == jnp.float32
    assert_close(y, want, 1e-5)
    g = jax.grad(lambda p: jnp.sum(ours.apply(p, x)))(params)
    assert all(a.dtype == jnp.float16 for a in jax.tree_util.tree_leaves(g))


def test_custom_dot_general_and_dot_general_cls_compute_as_stock():
    x = inputs((3, 6))
    calls = []

    def doubled(lhs, rhs, dims, precision=None, **kw):
        calls.append(precision)
        return 2 * jax.lax.dot_general(lhs, rhs, dims, precision=precision, **kw)

    class DoubledDot:
        def __call__(self, *args, **kw):
            return doubled(*args, **kw)

    hi = jax.lax.Precision.HIGHEST
    params = fnn.Dense(5).init(jax.random.key(0), x)
    for kw in [{"dot_general": doubled}, {"dot_general_cls": DoubledDot}]:
        ours = jb.nn.Dense(5, precision=hi, activation="relu", **kw)
        assert not on_kernels(ours, params, x)
        want = jax.nn.relu(fnn.Dense(5, precision=hi, **kw).apply(params, x))
        np.testing.assert_array_equal(np.asarray(ours.apply(params, x)), np.asarray(want))
    assert calls and all(p == hi for p in calls)


def test_custom_promote_dtype():
    x = inputs((4, 6))
    params = fnn.Dense(5).init(jax.random.key(0), x)

    def to_bf16(*args, dtype=None):
        return [None if a is None else jnp.asarray(a, jnp.bfloat16) for a in args]

    def to_f16(*args, dtype=None):
        return [None if a is None else jnp.asarray(a, jnp.float16) for a in args]

    # a promotion to a kernel dtype runs on the kernels, with what it returned
    ours = jb.nn.Dense(5, promote_dtype=to_bf16)
    assert on_kernels(ours, params, x)
    y, want = ours.apply(params, x), fnn.Dense(5, promote_dtype=to_bf16).apply(params, x)
    assert y.dtype == want.dtype == jnp.bfloat16
    assert_close(y, want, 2e-2)
    g = jax.grad(lambda p: jnp.sum(ours.apply(p, x).astype(jnp.float32)))(params)
    assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(g))
    # one the kernels cannot take computes as stock
    ours = jb.nn.Dense(5, promote_dtype=to_f16)
    assert not on_kernels(ours, params, x)
    np.testing.assert_array_equal(np.asarray(ours.apply(params, x)),
                                  np.asarray(fnn.Dense(5, promote_dtype=to_f16).apply(params, x)))


def test_precision_is_accepted_on_the_kernels():
    x = inputs((4, 6))
    params = fnn.Dense(5).init(jax.random.key(0), x)
    for precision in [None, "highest", jax.lax.Precision.DEFAULT]:
        ours = jb.nn.Dense(5, precision=precision)
        assert on_kernels(ours, params, x)
        assert_close(ours.apply(params, x), fnn.Dense(5, precision=precision).apply(params, x), 1e-5)


@pytest.mark.parametrize("param_dtype", [jnp.complex64, jnp.float32])
def test_complex_computes_as_stock(param_dtype):
    x = inputs((2, 3)).astype(jnp.complex64)
    ours, theirs = jb.nn.Dense(2, param_dtype=param_dtype), fnn.Dense(2, param_dtype=param_dtype)
    params = ours.init(jax.random.key(0), x)
    assert jax.tree_util.tree_map(lambda a: a.dtype, params) == \
        jax.tree_util.tree_map(lambda a: a.dtype, theirs.init(jax.random.key(0), x))
    y = ours.apply(params, x)
    assert y.dtype == jnp.complex64
    np.testing.assert_array_equal(np.asarray(y), np.asarray(theirs.apply(params, x)))


# --- what flax's own Dense tests check, in our words ---------------------------------------

def test_ones_initializers_give_the_input_width_plus_one():
    ones = fnn.initializers.ones
    for shape in [(1, 3), (1, 2, 3), (5, 1, 1, 3)]:
        y, _ = jb.nn.Dense(4, kernel_init=ones, bias_init=ones).init_with_output(
            jax.random.key(0), jnp.ones(shape))
        assert y.shape == shape[:-1] + (4,) and y.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(y), 4.0)
    y, _ = jb.nn.Dense(4, use_bias=False, kernel_init=ones).init_with_output(
        jax.random.key(0), jnp.ones((2, 3)))
    np.testing.assert_array_equal(np.asarray(y), 3.0)


def test_same_as_dense_general():
    x = jax.random.normal(jax.random.key(0), (5, 3))
    kw = dict(features=4, bias_init=fnn.initializers.normal())
    y1, p1 = jb.nn.Dense(**kw).init_with_output(jax.random.key(1), x)
    y2, p2 = fnn.DenseGeneral(**kw).init_with_output(jax.random.key(1), x)
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_close(y1, y2, 1e-6)


# --- empty batches, grad of grad, export ------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 6), (2, 0, 6), (0,) * 3 + (6,)])
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_empty_batch_like_flax(shape, dtype):
    layer, stock_layer = jb.nn.Dense(5, activation="gelu", dtype=dtype), fnn.Dense(5, dtype=dtype)
    x = jnp.zeros(shape)
    params = layer.init(jax.random.key(0), x)
    want_params = stock_layer.init(jax.random.key(0), x)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    y = jax.jit(layer.apply)(params, x)
    want = stock_layer.apply(params, x)
    assert y.shape == want.shape == shape[:-1] + (5,) and y.dtype == want.dtype
    g = jax.grad(lambda p: jnp.sum(layer.apply(p, x).astype(jnp.float32)))(params)
    for leaf, p in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(params), strict=True):
        assert leaf.shape == p.shape and leaf.dtype == p.dtype and not np.any(np.asarray(leaf))


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "sigmoid", "tanh"])
def test_gradient_penalty_matches_flax(activation):
    """A loss with the squared input gradient in it, differentiated w.r.t. the params."""
    x = inputs((6, 9))
    params = fnn.Dense(7).init(jax.random.key(2), x)
    ours = lambda p, x: jb.nn.Dense(7, activation=activation).apply(p, x)
    theirs = lambda p, x: apply_stock(7, activation, p, x)

    def penalized(apply):
        def loss(p):
            out = lambda x: jnp.sum(jnp.sin(apply(p, x)))
            return out(x) + jnp.sum(jax.grad(out)(x) ** 2)
        return loss

    g = jax.jit(jax.grad(penalized(ours)))(params)
    r = jax.grad(penalized(theirs))(params)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(r), strict=True):
        assert_close(a, b, 5e-5)
