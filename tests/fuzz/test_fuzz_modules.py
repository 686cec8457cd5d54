"""Property-based tests of jb.nn.Dense / Conv / LSTM and of the stock flax.linen modules
inside jb.accelerate(), against the stock modules on the same parameters: random fields
(features, use_bias, dtype, param_dtype, activation; kernel sizes, strides, every padding
form, dilations, feature groups, masks; time_major, return_carry, reverse, keep_order,
seq_lengths, initial carries), input dtypes and shapes (zeros included). Each either
equals the stock module (followed by the activation) within a tolerance, values and
gradients, or raises where the stock module raises."""

import flax.linen as nn
from flax.linen.linear import canonicalize_padding
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jax_brgemm as jb
from fuzz_support import (REF_ACT, activations, assert_close, dtypes, make, mostly, profile, sizes,
                          stock_outcome, tolerance, weighed_sum, weights)

# Initializers that take zero sizes: stock checks a given parameter's shape by evaluating
# its initializer, and the default ones divide by the fan-in / fan-out.
INITS = dict(kernel_init=nn.initializers.normal(0.1))
LSTM_INITS = dict(INITS, recurrent_kernel_init=nn.initializers.normal(0.1))
module_dtypes = mostly([None, None, "float32", "bfloat16"], "float16", times=2)
param_dtypes = mostly(["float32"], "bfloat16", times=3)


def result_tolerance(tree, depth=1):
    leaves = jax.tree_util.tree_leaves(tree)
    worst = max((np.dtype(a.dtype) for a in leaves), key=lambda d: tolerance(d), default=np.dtype("float32"))
    return tolerance(worst, depth)


# The stock RNN's own scan refuses a carry whose dtype the cell's step changes (a bfloat16
# carry from param_dtype=bfloat16 that the step promotes to float32); the fused call has
# no such carry and computes the result.
STOCK_SCAN_CARRY = "carry input and carry output must have equal types"


def compare(ours, stock, params, x, rng, depth=1, precision=None, grads=True):
    """``ours(params, x)`` against ``stock(params, x)``: the same refusal, or the same
    result within the tolerance of the result's dtype or of ``precision`` (the computation
    dtype) if less precise; with float32 results and parameters also the gradients w.r.t.
    the parameters and a floating-point input."""
    # jitted: one compilation per example instead of one per primitive and shape
    ours, stock = jax.jit(ours), jax.jit(stock)
    want, error = stock_outcome(lambda: stock(params, x))
    if error is not None:
        if STOCK_SCAN_CARRY in str(error):
            return
        with pytest.raises((type(error), ValueError, TypeError, NotImplementedError)):
            jax.block_until_ready(ours(params, x))
        return
    got = ours(params, x)
    tol = max(result_tolerance(want, depth), tolerance(precision or "float64", depth))
    assert_close(got, want, tol)
    leaves = jax.tree_util.tree_leaves((want, params))
    if grads and all(a.dtype == jnp.float32 for a in leaves) and all(a.size for a in jax.tree_util.tree_leaves(want)):
        w = weights(rng, want)
        floating = jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
        argnums = (0, 1) if floating else (0,)
        grad = lambda f: jax.grad(lambda p, x: weighed_sum(f(p, x), w), argnums=argnums)  # noqa: E731
        assert_close(grad(ours)(params, x), grad(stock)(params, x), 50 * tol)


def accelerated(module, **kw):
    def apply(params, x):
        with jb.accelerate():
            return module.apply(params, x, **kw)
    return apply


def on_kernels(module, params, x) -> bool:
    """Whether accelerate() runs ``module``'s call on the kernels."""
    try:
        with jb.accelerate() as acc:
            jax.eval_shape(module.apply, params, x)
    except Exception:  # noqa: BLE001 -- stock refuses: so does the call on the kernels
        return True
    return all(c.accelerated for c in acc.calls)


def with_activation(module, activation, **kw):
    return lambda params, x: REF_ACT[activation](module.apply(params, x, **kw))


def check_init(ours, stock, x):
    """The same parameter tree (names, shapes, dtypes, values) from the same key, or the
    same refusal."""
    want, error = stock_outcome(lambda: stock.init(jax.random.key(3), x))
    if error is not None:
        if STOCK_SCAN_CARRY in str(error):
            return
        with pytest.raises(Exception):  # noqa: B017 -- whatever stock raises
            ours.init(jax.random.key(3), x)
        return
    assert_close(ours.init(jax.random.key(3), x), want, 0)


@profile(6)
@given(st.data())
def test_dense_module(data):
    d = data.draw
    lead = tuple(d(st.lists(sizes(3), max_size=2)))
    c, k = d(sizes(6)), d(sizes(6))
    use_bias, dtype, param_dtype = d(st.booleans()), d(module_dtypes), d(param_dtypes)
    x_dtype, act, seed = d(dtypes), d(activations), d(st.integers(0, 999))
    rng = np.random.default_rng(seed)
    x = make(rng, lead + (c,), x_dtype)
    params = {"params": {"kernel": make(rng, (c, k), param_dtype, 1 / np.sqrt(max(c, 1)))}}
    if use_bias:
        params["params"]["bias"] = make(rng, (k,), param_dtype)
    fields = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, **INITS)
    stock = nn.Dense(k, **fields)
    compare(jb.nn.Dense(k, **fields, activation=act).apply, with_activation(stock, act), params, x, rng)
    compare(accelerated(stock), stock.apply, params, x, rng)
    check_init(jb.nn.Dense(k, **fields), stock, x)


def stock_conv(features, kernel_size, fields, activation, rank):
    """``flax.linen.Conv`` followed by the activation. Negative pads are applied first, as
    the crops they are, by ``lax.pad``, the rest by the stock module: XLA's own cropping
    convolution reads garbage now and then."""
    padding, conv = fields["padding"], nn.Conv(features, kernel_size, **fields)
    if isinstance(padding, str) or fields["input_dilation"] != 1:
        return with_activation(conv, activation)
    pairs = canonicalize_padding(padding, rank)
    if all(v >= 0 for p in pairs for v in p):
        return with_activation(conv, activation)
    rest = nn.Conv(features, kernel_size, **dict(fields, padding=[(max(lo, 0), max(hi, 0)) for lo, hi in pairs]))

    def apply(params, x):
        x = jnp.asarray(x)
        if any(n + min(lo, 0) + min(hi, 0) < 1 for n, (lo, hi) in zip(x.shape[-rank - 1:-1], pairs)):
            return REF_ACT[activation](conv.apply(params, x))  # cropped away: empty
        config = [(0, 0, 0)] * (x.ndim - rank - 1) + [(min(lo, 0), min(hi, 0), 0) for lo, hi in pairs] + [(0, 0, 0)]
        return REF_ACT[activation](rest.apply(params, jax.lax.pad(x, jnp.zeros((), x.dtype), config)))
    return apply


def conv_paddings(rank):
    pairs = [(1, 0), (0, 2), (2, 2), (-1, 1), (0, -2)]
    explicit = st.lists(st.sampled_from(pairs + [0, 1]), min_size=rank, max_size=rank).map(tuple)
    forms = ["SAME", "VALID", "CIRCULAR", "REFLECT", 1, 0, -1] + (["CAUSAL"] if rank == 1 else [])
    return st.one_of(st.sampled_from(forms), explicit)


def per_dim(rank, values):
    return st.one_of(st.sampled_from(values), st.lists(st.sampled_from(values), min_size=rank, max_size=rank)
                     .map(tuple))


@profile(8)
@given(st.data())
def test_conv_module(data):
    d = data.draw
    rank = d(mostly([2], 1, times=3))
    kernel_size = tuple(d(st.lists(st.integers(1, 3), min_size=rank, max_size=rank)))
    batch = tuple(d(mostly([[2], [1]], [], [2, 1], times=3)))
    spatial = tuple(d(st.lists(sizes(6), min_size=rank, max_size=rank)))
    c, k = d(mostly([1, 2, 3, 4], 0)), d(st.integers(1, 4))
    strides, padding = d(per_dim(rank, [1, 1, 2, 3])), d(conv_paddings(rank))
    input_dilation, kernel_dilation = d(mostly([1], 2, times=8)), d(mostly([1], 2, times=8))
    groups = d(mostly([1], 2, times=8))
    use_bias, dtype, param_dtype = d(st.booleans()), d(module_dtypes), d(param_dtypes)
    x_dtype, act, with_mask, seed = d(dtypes), d(activations), d(mostly([False], True, times=8)), d(st.integers(0, 999))
    rng = np.random.default_rng(seed)
    x = make(rng, batch + spatial + (c,), x_dtype)
    kernel_shape = kernel_size + (c // groups if c % groups == 0 else c, k)
    fan_in = max(int(np.prod(kernel_shape[:-1])), 1)
    params = {"params": {"kernel": make(rng, kernel_shape, param_dtype, 1 / np.sqrt(fan_in))}}
    if use_bias:
        params["params"]["bias"] = make(rng, (k,), param_dtype)
    mask = jnp.asarray(rng.integers(0, 2, kernel_shape), jnp.float32) if with_mask else None
    fields = dict(strides=strides, padding=padding, input_dilation=input_dilation, kernel_dilation=kernel_dilation,
                  feature_group_count=groups, use_bias=use_bias, mask=mask, dtype=dtype, param_dtype=param_dtype,
                  **INITS)
    stock = nn.Conv(k, kernel_size, **fields)
    compare(jb.nn.Conv(k, kernel_size, **fields, activation=act).apply, stock_conv(k, kernel_size, fields, act, rank),
            params, x, rng)
    if not with_mask:
        check_init(jb.nn.Conv(k, kernel_size, **fields), stock, x)
    crops = not isinstance(padding, str) and min(v for p in canonicalize_padding(padding, rank) for v in p) < 0
    if crops and not on_kernels(stock, params, x):
        return  # accelerate() runs the stock module: XLA's cropping convolution, garbage and all
    compare(accelerated(stock), stock_conv(k, kernel_size, fields, None, rank), params, x, rng)


def lstm_cell_params(rng, c, k, param_dtype):
    cell = {}
    for gate in "ifgo":
        cell[f"i{gate}"] = {"kernel": make(rng, (c, k), param_dtype, 1 / np.sqrt(max(c, 1)))}
        cell[f"h{gate}"] = {"kernel": make(rng, (k, k), param_dtype, 1 / np.sqrt(max(k, 1))),
                            "bias": make(rng, (k,), param_dtype, 0.1)}
    return {"params": {"cell": cell}}


@profile(6)
@given(st.data())
def test_lstm_module(data):
    d = data.draw
    batch = tuple(d(sizes(3)) for _ in range(d(mostly([1], 2, times=3))))
    t, c, k = d(sizes(4)), d(mostly([1, 2, 3, 5], 0)), d(mostly([1, 2, 4, 6], 0))
    time_major, return_carry = d(st.booleans()), d(st.booleans())
    reverse, keep_order = d(mostly([False], True, times=2)), d(st.booleans())
    with_carry, with_lengths = d(st.booleans()), d(mostly([False], True, times=3))
    dtype, param_dtype = d(module_dtypes), d(param_dtypes)
    x_dtype, carry_dtype = d(dtypes), d(mostly(["float32"], "bfloat16", times=3))
    cell, seed = d(st.sampled_from([nn.OptimizedLSTMCell, nn.LSTMCell])), d(st.integers(0, 999))
    # one of the two gradients, and the parameter tree now and then: scans compile slowly
    grads_of, init = d(st.sampled_from(["module", "accelerate"])), d(mostly([False], True, times=2))
    rng = np.random.default_rng(seed)
    x = make(rng, ((t,) + batch if time_major else batch + (t,)) + (c,), x_dtype, 0.5)
    params = lstm_cell_params(rng, c, k, param_dtype)
    call = dict(return_carry=return_carry, time_major=time_major, reverse=reverse, keep_order=keep_order)
    if with_carry:
        call["initial_carry"] = tuple(make(rng, batch + (k,), carry_dtype, 0.5) for _ in range(2))
    if with_lengths:
        call["seq_lengths"] = jnp.asarray(rng.integers(0, t + 1, batch), jnp.int32)
    stock = nn.RNN(nn.OptimizedLSTMCell(k, dtype=dtype, param_dtype=param_dtype, **LSTM_INITS))
    ours = jb.nn.LSTM(k, dtype=dtype, param_dtype=param_dtype, **LSTM_INITS)
    depth = 3 * max(t, 1)
    precision = np.dtype(dtype) if dtype else jnp.result_type(jnp.asarray(x), jnp.dtype(param_dtype))
    compare(lambda p, x: ours.apply(p, x, **call), lambda p, x: stock.apply(p, x, **call), params, x, rng,
            depth, precision, grads=grads_of == "module")
    twin = nn.RNN(cell(k, dtype=dtype, param_dtype=param_dtype, **LSTM_INITS))
    compare(accelerated(twin, **call), lambda p, x: twin.apply(p, x, **call), params, x, rng, depth, precision,
            grads=grads_of == "accelerate")
    if init:
        check_init(ours, stock, x)
