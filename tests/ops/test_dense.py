"""jb.dense against jnp: outputs and gradients over shapes, activations, dtypes, vmap, jit,
NaN propagation and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_brgemm as jb
from stock_reference import loss, assert_close

ACTS = [None, "relu", "gelu", "sigmoid", "tanh"]
REF_ACT = {None: lambda v: v, "relu": jax.nn.relu, "gelu": jax.nn.gelu,  # tanh approximation
           "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}
HI = jax.lax.Precision.HIGHEST


def reference(x, kernel, bias=None, activation=None, dtype=None):
    """What jb.dense computes, in float32 from the operands rounded to the compute dtype."""
    if dtype is None:
        dtype = jnp.result_type(*(a for a in (x, kernel, bias) if a is not None))
    xf = x.astype(dtype).astype(jnp.float32)
    kf = kernel.astype(dtype).astype(jnp.float32)
    y = jnp.matmul(xf, kf, precision=HI)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return REF_ACT[activation](y).astype(dtype)


def data(shape_x, c, k, dtype=jnp.float32, kernel_dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape_x + (c,), np.float32), dtype)
    kernel = jnp.asarray(rng.standard_normal((c, k), np.float32) / np.sqrt(c), kernel_dtype)
    bias = jnp.asarray(0.5 * rng.standard_normal((k,), np.float32), kernel_dtype)
    return x, kernel, bias


def value_and_grads(f, argnums):
    """jit(y, grads of loss(f)) in one compilation."""
    def both(*args):
        return f(*args), jax.grad(loss(f), argnums)(*args)
    return jax.jit(both)


def check(shape_x, c, k, act, use_bias, dtype, tol):
    x, kernel, bias = data(shape_x, c, k, dtype, dtype)
    b = bias if use_bias else None
    argnums = (0, 1, 2) if use_bias else (0, 1)
    y, g = value_and_grads(lambda x, w, b: jb.dense(x, w, b, activation=act), argnums)(x, kernel, b)
    want, r = value_and_grads(lambda x, w, b: reference(x, w, b, act), argnums)(x, kernel, b)
    assert y.dtype == dtype and y.shape == shape_x + (k,)
    assert_close(y, want, tol)
    for gi, ri, arg in zip(g, r, (x, kernel, bias)[:len(argnums)], strict=True):
        assert gi.dtype == arg.dtype and gi.shape == arg.shape
        assert_close(gi, ri, tol)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("use_bias", [True, False])
def test_every_activation_fp32(act, use_bias):
    check((37,), 70, 130, act, use_bias, jnp.float32, 2e-5)


@pytest.mark.parametrize("act", ACTS)
def test_every_activation_bf16(act):
    check((37,), 70, 130, act, True, jnp.bfloat16, 3e-2)


@pytest.mark.parametrize("shape_x,c,k", [
    ((1,), 1, 1),            # size 1 everywhere
    ((), 5, 3),              # x of rank 1
    ((2, 3, 5), 9, 2),       # leading dims fold into N
    ((100,), 512, 70),       # several reduction blocks, edge column blocks
    ((13,), 300, 257),       # sizes that are no multiple of any block
    ((257,), 64, 64),
    ((40,), 2600, 300),      # long reductions: panels narrower than 128 columns (fwd)
    ((40,), 300, 2600),      # (bwd)
    ((3100,), 1030, 1030),   # a large batch against many panels: the weights re-blocked
                             # first (fwd and bwd), the update in chunks
])
def test_shapes(shape_x, c, k):
    check(shape_x, c, k, "tanh", True, jnp.float32, 2e-5)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple),
       n=st.integers(1, 70), c=st.integers(1, 130), k=st.integers(1, 130),
       act=st.sampled_from(ACTS), use_bias=st.booleans(), bf16=st.booleans())
def test_hypothesis_shapes(lead, n, c, k, act, use_bias, bf16):
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    check(lead + (n,), c, k, act, use_bias, dtype, 3e-2 if bf16 else 3e-5)


def test_bf16_compute_with_fp32_params():
    """Flax's dtype=bf16, param_dtype=f32: bf16 output, fp32 kernel and bias gradients."""
    # (tanh, not relu: relu's derivative jumps where a pre-activation sits at 0 within the
    # rounding of a different summation order)
    x, kernel, bias = data((24,), 48, 40)
    xb = x.astype(jnp.bfloat16)
    f = lambda x, w, b: jb.dense(x, w, b, activation="tanh", dtype=jnp.bfloat16)
    y = jax.jit(f)(xb, kernel, bias)
    assert y.dtype == jnp.bfloat16
    assert_close(y, reference(xb, kernel, bias, "tanh", jnp.bfloat16), 2e-2)
    g = jax.jit(jax.grad(loss(f), (0, 1, 2)))(xb, kernel, bias)
    assert [a.dtype for a in g] == [jnp.bfloat16, jnp.float32, jnp.float32]
    r = jax.grad(loss(lambda x, w, b: reference(x, w, b, "tanh", jnp.bfloat16)), (0, 1, 2))(xb, kernel, bias)
    for gi, ri in zip(g, r, strict=True):
        assert_close(gi, ri, 3e-2)
    # mixed dtypes without dtype= promote like jnp: bf16 x with an fp32 kernel computes in fp32
    assert jb.dense(xb, kernel, bias).dtype == jnp.float32


def test_vmap_folds_leading_batch():
    x, kernel, bias = data((4, 9), 33, 20)
    f = lambda x: jb.dense(x, kernel, bias, activation="sigmoid")
    assert_close(jax.jit(jax.vmap(f))(x), reference(x, kernel, bias, "sigmoid"), 2e-5)
    # gradients through vmap, w.r.t. the shared parameters (summed over the vmapped axis)
    g = jax.grad(lambda w, b: jnp.sum(jax.vmap(lambda xi: jb.dense(xi, w, b, activation="tanh"))(x) ** 2),
                 (0, 1))(kernel, bias)
    r = jax.grad(lambda w, b: jnp.sum(reference(x, w, b, "tanh") ** 2), (0, 1))(kernel, bias)
    for gi, ri in zip(g, r, strict=True):
        assert_close(gi, ri, 2e-5)


def test_vmap_over_weights_and_per_example_grads():
    xs, _, _ = data((3, 7), 10, 6, seed=1)
    _, ks, bs = data((), 10, 6, seed=2)
    ks, bs = jnp.stack([ks, 2 * ks, -ks]), jnp.stack([bs, 0 * bs, bs + 1])
    y = jax.jit(jax.vmap(lambda x, w, b: jb.dense(x, w, b, activation="relu")))(xs, ks, bs)
    want = jnp.stack([reference(xs[i], ks[i], bs[i], "relu") for i in range(3)])
    assert_close(y, want, 2e-5)
    # unbatched x, batched weights
    y = jax.vmap(lambda w: jb.dense(xs[0], w))(ks)
    assert_close(y, jnp.stack([reference(xs[0], ks[i]) for i in range(3)]), 2e-5)
    # per-example gradients: vmap of grad
    per = jax.jit(jax.vmap(jax.grad(lambda w, x: jnp.sum(jb.dense(x, w, activation="gelu") ** 2)),
                           in_axes=(None, 0)))(ks[0], xs)
    want = jnp.stack([jax.grad(lambda w: jnp.sum(reference(xs[i], w, None, "gelu") ** 2))(ks[0])
                      for i in range(3)])
    assert_close(per, want, 2e-5)


def test_jacobians():
    x, kernel, bias = data((3,), 5, 4)
    f = lambda x: jb.dense(x, kernel, bias, activation="sigmoid")
    assert_close(jax.jacrev(f)(x), jax.jacrev(lambda x: reference(x, kernel, bias, "sigmoid"))(x), 2e-5)


def test_nan_propagates_like_xla():
    x, kernel, bias = data((6,), 8, 20)
    x = x.at[2, 3].set(jnp.nan)
    for act in ACTS:
        y = np.asarray(jb.dense(x, kernel, bias, activation=act))
        want = np.asarray(reference(x, kernel, bias, act))
        np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
        assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()
    inf_kernel = kernel.at[1, 5].set(jnp.inf)
    y = np.asarray(jb.dense(jnp.abs(x[:2]), inf_kernel))
    assert np.isposinf(y[:, 5]).all()
    g = jax.grad(lambda w: jnp.sum(jb.dense(x, w, activation="tanh")))(kernel)
    r = jax.grad(lambda w: jnp.sum(reference(x, w, None, "tanh")))(kernel)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(r))


def test_dx_call_is_dropped_when_unused():
    """Only the weight update runs when the input needs no gradient (a first layer)."""
    x, kernel, bias = data((8,), 16, 12)
    hlo = jax.jit(jax.grad(lambda w, b: jnp.sum(jb.dense(x, w, b, activation="relu")), (0, 1))).lower(
        kernel, bias).compile().as_text()
    assert "jb_fc_upd" in hlo and "jb_fc_bwd" not in hlo


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh", "gelu"])
def test_first_order_backward_is_three_calls(activation):
    """dz = dy * act'(saved) once (jb_fc_act_grad), then the two linear passes read it."""
    x, kernel, bias = data((8,), 16, 12)
    f = lambda x, w, b: jnp.sum(jb.dense(x, w, b, activation=activation) ** 2)
    hlo = jax.jit(jax.grad(f, (0, 1, 2))).lower(x, kernel, bias).compile().as_text()
    assert all(hlo.count(f'custom_call_target="{t}"') == 1 for t in ("jb_fc_act_grad", "jb_fc_bwd", "jb_fc_upd"))


@pytest.mark.parametrize("args,kwargs,err,match", [
    (((3, 4), (5, 6)), {}, ValueError, "features"),
    (((3, 4), (4,)), {}, ValueError, r"\(C, K\)"),
    (((3, 4), (4, 6, 1)), {}, ValueError, r"\(C, K\)"),
    ((None, (4, 6)), {}, ValueError, "rank"),
    (((3, 4), (4, 6), (5,)), {}, ValueError, "bias"),
    (((3, 4), (4, 6), (1, 6)), {}, ValueError, "bias"),
    (((3, 4), (4, 6)), {"activation": "swish"}, ValueError, "unknown activation"),
    (((3, 4), (4, 6)), {"activation": jax.nn.relu}, TypeError, "activation"),
    (((3, 4), (4, 6)), {"dtype": jnp.float16}, TypeError, "dtype must be float32 or bfloat16"),
    (((3, 4), (4, 6)), {"dtype": "nonsense"}, TypeError, "dtype"),
])
def test_bad_input(args, kwargs, err, match):
    arrays = [jnp.zeros(()) if s is None else jnp.ones(s, jnp.float32) for s in args]
    with pytest.raises(err, match=match):
        jb.dense(*arrays, **kwargs)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.int32])
def test_unsupported_dtypes(dtype):
    with pytest.raises(TypeError, match="x must be float32 or bfloat16"):
        jb.dense(jnp.ones((2, 3), dtype), jnp.ones((3, 4)))
    with pytest.raises(TypeError, match="kernel must be float32 or bfloat16"):
        jb.dense(jnp.ones((2, 3)), jnp.ones((3, 4), dtype))
    with pytest.raises(TypeError, match="bias must be float32 or bfloat16"):
        jb.dense(jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones((4,), dtype))


@pytest.mark.parametrize("target,args,outs,match", [
    ("jb_fc_fwd", [(4, 8), (9, 5), (0,)], [((4, 5), "f32"), ((0,), "f32")], "w has shape"),
    ("jb_fc_fwd", [(4, 8), (8, 5), (6,)], [((4, 5), "f32"), ((0,), "f32")], "bias has shape"),
    ("jb_fc_fwd", [(4, 8), (8, 5), (0,)], [((4, 5), "bf16"), ((0,), "f32")], "float32 or all bfloat16"),
    ("jb_fc_fwd", [(4, 8), (8, 5), (0,)], [((4, 5), "f32"), ((4, 5), "f32")], "z must be empty"),
    ("jb_fc_bwd", [(4, 5), (8, 6)], [((4, 8), "f32")], "dz has shape"),
    ("jb_fc_bwd", [(4, 6), (8, 6)], [((4, 8), "bf16")], "dz and dx must both"),
    ("jb_fc_upd", [(4, 8), (3, 5)], [((8, 5), "f32"), ((5,), "f32")], "dz has shape"),
    ("jb_fc_upd", [(4, 8), (4, 5)], [((8, 5), "f32"), ((4,), "f32")], "db"),
    ("jb_fc_upd", [(4, 6), (4, 5)], [((8, 5), "f32"), ((5,), "f32")], "fewer columns than dw"),
    ("jb_fc_act_grad", [(4, 5), (4, 5)], [((4, 5), "f32")], "needs an activation"),
])
def test_ffi_handlers_validate(target, args, outs, match):
    """Called directly with inconsistent buffers, the handlers return an error, not a crash."""
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}
    arrays = [jnp.ones(s, jnp.float32) for s in args]
    structs = [jax.ShapeDtypeStruct(s, dt[d]) for s, d in outs]
    call = jax.ffi.ffi_call(target, structs if len(structs) > 1 else structs[0])
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(*arrays, **_attrs(target)))


def _attrs(target, products=0):
    act = {"act": np.int32(0)} if target in ("jb_fc_fwd", "jb_fc_act_grad") else {}
    return act if target == "jb_fc_act_grad" else {**act, "products": np.int64(products)}


@pytest.mark.parametrize("products,dtype,match", [(2, jnp.float32, "products = 2; 0"),
                                                  (-1, jnp.float32, "products = -1; 0"),
                                                  (3, jnp.bfloat16, "take float32 operands")])
@pytest.mark.parametrize("target", ["jb_fc_fwd", "jb_fc_bwd", "jb_fc_upd"])
def test_ffi_handlers_refuse_products_they_cannot_compute(target, products, dtype, match):
    a, b = jnp.ones((4, 8), dtype), jnp.ones((8, 5) if target == "jb_fc_fwd" else (4, 5), dtype)
    outs = {"jb_fc_fwd": [((4, 5), dtype), ((0,), dtype)], "jb_fc_bwd": [((4, 8), dtype)],
            "jb_fc_upd": [((8, 5), jnp.float32), ((0,), jnp.float32)]}[target]
    args = {"jb_fc_fwd": (a, b, jnp.zeros((0,), jnp.float32)), "jb_fc_bwd": (b, jnp.ones((8, 5), dtype)),
            "jb_fc_upd": (a, b)}[target]
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in outs]
    call = jax.ffi.ffi_call(target, structs if len(structs) > 1 else structs[0])
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(*args, **_attrs(target, products)))


# --- sizes of zero ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape_x,c,k", [
    ((0,), 5, 3),        # an empty batch
    ((2, 0), 5, 3),      # a 0-size leading dim among others
    ((0, 4), 1, 1),
    ((3,), 0, 4),        # no input features: the result is act(bias)
    ((3,), 5, 0),        # no output features: an empty result
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_zero_sizes_compute_what_xla_computes(shape_x, c, k, dtype):
    x, kernel, bias = data(shape_x, c, k, dtype, dtype)
    f = lambda x, w, b: jb.dense(x, w, b, activation="sigmoid")
    y = jax.jit(f)(x, kernel, bias)
    want = reference(x, kernel, bias, "sigmoid")
    assert y.shape == shape_x + (k,) and y.dtype == dtype
    assert_close(y, want, 1e-2)
    g = jax.grad(loss(f), (0, 1, 2))(x, kernel, bias)
    r = jax.grad(loss(lambda x, w, b: reference(x, w, b, "sigmoid")), (0, 1, 2))(x, kernel, bias)
    for gi, ri, arg in zip(g, r, (x, kernel, bias), strict=True):
        assert gi.shape == arg.shape and gi.dtype == arg.dtype
        assert_close(gi, ri, 1e-2)
    # and under grad of grad
    gg = jax.grad(lambda w: jnp.sum(jax.grad(loss(f), 0)(x, w, bias) ** 2))(kernel)
    assert gg.shape == kernel.shape


# --- grad of grad ------------------------------------------------------------------------------

def gradient_penalty(f):
    """A loss with a gradient penalty: the first derivative inside, differentiated again."""
    def penalized(x, w, b):
        value, dx = jax.value_and_grad(loss(f), 0)(x, w, b)
        return value + jnp.sum(dx.astype(jnp.float32) ** 2)
    return penalized


def check_second_order(shape_x, c, k, act, use_bias, dtype, tol, seed=0):
    x, kernel, bias = data(shape_x, c, k, dtype, dtype, seed=seed)
    b = bias if use_bias else None
    argnums = (0, 1, 2) if use_bias else (0, 1)
    ours = gradient_penalty(lambda x, w, b: jb.dense(x, w, b, activation=act))
    theirs = gradient_penalty(lambda x, w, b: reference(x, w, b, act))
    g = jax.jit(jax.grad(ours, argnums))(x, kernel, b)
    r = jax.grad(theirs, argnums)(x, kernel, b)
    for gi, ri, arg in zip(g, r, (x, kernel, bias)[:len(argnums)], strict=True):
        assert gi.dtype == arg.dtype and gi.shape == arg.shape
        assert_close(gi, ri, tol)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("use_bias", [True, False])
def test_grad_of_grad_fp32(act, use_bias):
    check_second_order((9,), 13, 7, act, use_bias, jnp.float32, 5e-5)


@pytest.mark.parametrize("act", ACTS)
def test_grad_of_grad_bf16(act):
    check_second_order((9,), 13, 7, act, True, jnp.bfloat16, 6e-2)


@pytest.mark.slow  # ~12 s; fixed-shape grad of grad runs in the quick tier
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=1).map(tuple),
       n=st.integers(1, 20), c=st.integers(1, 40), k=st.integers(1, 40),
       act=st.sampled_from(ACTS))
def test_hypothesis_grad_of_grad(lead, n, c, k, act):
    check_second_order(lead + (n,), c, k, act, True, jnp.float32, 1e-4)


def test_grad_of_grad_with_mixed_precision():
    """bf16 compute with fp32 params: the second derivative keeps each argument's dtype."""
    x, kernel, bias = data((6,), 10, 5)
    xb = x.astype(jnp.bfloat16)
    f = gradient_penalty(lambda x, w, b: jb.dense(x, w, b, activation="tanh", dtype=jnp.bfloat16))
    r = gradient_penalty(lambda x, w, b: reference(x, w, b, "tanh", jnp.bfloat16))
    g = jax.grad(f, (0, 1, 2))(xb, kernel, bias)
    assert [a.dtype for a in g] == [jnp.bfloat16, jnp.float32, jnp.float32]
    for gi, ri in zip(g, jax.grad(r, (0, 1, 2))(xb, kernel, bias), strict=True):
        assert_close(gi, ri, 6e-2)


def test_grad_of_grad_runs_on_the_kernels():
    """Hessian-vector product by grad of grad: every matmul is one of the FC custom calls."""
    x, kernel, bias = data((8,), 16, 12)
    f = lambda w: jnp.sum(jnp.sin(jb.dense(x, w, bias, activation="gelu")))
    v = jnp.ones_like(kernel)
    hvp = jax.jit(lambda w: jax.grad(lambda w: jnp.vdot(jax.grad(f)(w), v))(w))
    hlo = hvp.lower(kernel).compile().as_text()
    assert "jb_fc_fwd" in hlo and "jb_fc_upd" in hlo
    assert " dot(" not in hlo and "dot_general" not in hlo
    want = jax.grad(lambda w: jnp.vdot(jax.grad(
        lambda w: jnp.sum(jnp.sin(reference(x, w, bias, "gelu"))))(w), v))(kernel)
    assert_close(hvp(kernel), want, 5e-5)


def test_third_order():
    x, kernel, bias = data((4,), 6, 3)
    f = lambda x: jnp.sum(jb.dense(x, kernel, bias, activation="tanh"))
    r = lambda x: jnp.sum(reference(x, kernel, bias, "tanh"))
    third = lambda f: jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x)))
    assert_close(third(f)(x), third(r)(x), 1e-4)


def test_activation_table_comes_from_cpp():
    """Names and codes are C++'s (jb::kActivationNames); every name has its jnp twin, in one
    table that the public names share (not copies of it)."""
    from jax_brgemm import _activations, _native, models

    codes = _native.ACTIVATION_CODES
    assert set(codes) == {"none"} | set(_activations.ACTIVATIONS)
    assert len(set(codes.values())) == len(codes) and codes["none"] == 0
    assert set(ACTS) == {None} | set(_activations.ACTIVATIONS)
    assert jb.nn.ACTIVATIONS is _activations.ACTIVATIONS and models.ACTIVATIONS is _activations.ACTIVATIONS
    for name in ACTS:
        assert _activations.name_of(_activations.code_of(name)) == name


def _rel_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(out - ref)) / np.max(np.abs(ref))


def test_long_reductions_are_as_accurate_as_xla():
    # Gradients summed over 256K rows of a nonzero mean: the kernels sum in bounded chunks
    # (and the bias pairwise), so their error against float64 stays near XLA's.
    rng = np.random.default_rng(0)
    rows, c, k = 2 ** 18, 8, 8
    x, dy = rng.random((rows, c), np.float32), rng.random((rows, k), np.float32)
    w, b = rng.random((c, k), np.float32), np.zeros(k, np.float32)

    def grads(f):
        return jax.jit(jax.grad(lambda w, b, x, dy: jnp.vdot(f(x, w, b), dy), argnums=(0, 1)))(w, b, x, dy)

    ours, stock = grads(lambda x, w, b: jb.dense(x, w, b)), grads(lambda x, w, b: x @ w + b)
    refs = (x.astype(np.float64).T @ dy.astype(np.float64), dy.astype(np.float64).sum(0))
    for mine, xla, ref in zip(ours, stock, refs):
        assert _rel_error(mine, ref) <= max(8 * _rel_error(xla, ref), 1e-6)
