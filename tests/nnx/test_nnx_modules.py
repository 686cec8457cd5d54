"""jax_brgemm.nnx's Linear, Conv, LSTM and RNN against flax.nnx's: the same state from the same
rngs, the same outputs and gradients (float32 and bfloat16, odd sizes, every Conv padding
form, the LSTM's call conventions), on the kernels where they can run and stock elsewhere,
under nnx.jit / nnx.vmap / jax.vmap, and clear errors on bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_brgemm as jb
import jax_brgemm.nnx as jbnnx
from stock_reference import conv_general_dilated as exact_conv

F32, BF16 = jnp.float32, jnp.bfloat16
ACTIVATIONS = {None: lambda y: y, "relu": jax.nn.relu, "gelu": jax.nn.gelu,
               "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}


def normal(seed, shape, dtype=F32):
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def tol(dtype):
    return dict(rtol=2e-2, atol=3e-2) if dtype == BF16 else dict(rtol=2e-5, atol=2e-5)


def close(a, b, dtype=F32, **kw):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               **{**tol(dtype), **kw})


def kernel_calls(model, *args, **kwargs) -> int:
    """How many jax_brgemm custom calls ``model(*args, **kwargs)`` lowers to."""
    graphdef, state = nnx.split(model)

    def run(state, *args):
        return nnx.merge(graphdef, state)(*args, **kwargs)

    # in the lowered program: a kernel pass is a primitive, its custom call made when lowered
    return jax.jit(run).lower(state, *args).as_text().count("custom_call @jb_")


def same_state(a, b):
    sa, sb = nnx.state(a), nnx.state(b)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def grads(model, x, **kwargs):
    """d(sum of squares of the output)/d(params, x)."""

    def loss(model, x):
        y = model(x, **kwargs)
        return sum(jnp.sum(jnp.square(v.astype(F32))) for v in jax.tree.leaves(y))

    return nnx.grad(loss, argnums=(0, 1))(model, x)


def same_grads(ours, stock, x, dtype=F32, **kwargs):
    (gp, gx), (sp, sx) = grads(ours, x, **kwargs), grads(stock, x, **kwargs)
    assert gx.dtype == sx.dtype
    scale = max(1.0, float(jnp.max(jnp.abs(sx.astype(F32)))))
    close(gx, sx, dtype, atol=tol(dtype)["atol"] * scale)
    assert jax.tree.structure(gp) == jax.tree.structure(sp)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(sp)):
        assert a.dtype == b.dtype
        scale = max(1.0, float(jnp.max(jnp.abs(b.astype(F32)))))
        close(a, b, dtype, atol=tol(dtype)["atol"] * scale)


# --- Linear ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape,out,use_bias", [((5, 13), 17, True), ((2, 3, 7), 1, False),
                                                 ((1, 33), 65, True)])
def test_linear_matches_stock(shape, out, use_bias, dtype):
    kw = dict(use_bias=use_bias, dtype=dtype)
    ours = jbnnx.Linear(shape[-1], out, rngs=nnx.Rngs(3), **kw)
    stock = nnx.Linear(shape[-1], out, rngs=nnx.Rngs(3), **kw)
    same_state(ours, stock)
    x = normal(1, shape, dtype)
    y = ours(x)
    assert y.dtype == stock(x).dtype and y.shape == shape[:-1] + (out,)
    close(y, stock(x), dtype)
    assert kernel_calls(ours, x) == 1
    same_grads(ours, stock, x, dtype)


@pytest.mark.parametrize("activation", ["relu", "gelu", "sigmoid", "tanh"])
def test_linear_activation_is_stock_followed_by_it(activation):
    ours = jbnnx.Linear(9, 11, rngs=nnx.Rngs(0), activation=activation)
    stock = nnx.Linear(9, 11, rngs=nnx.Rngs(0))
    x = normal(2, (4, 9))
    close(ours(x), ACTIVATIONS[activation](stock(x)))
    gx = jax.grad(lambda x: jnp.sum(ours(x) ** 2))(x)
    close(gx, jax.grad(lambda x: jnp.sum(ACTIVATIONS[activation](stock(x)) ** 2))(x))


@pytest.mark.parametrize("kw,on_kernels", [
    (dict(param_dtype=BF16), True),                       # bf16 params, bf16 computation
    (dict(dtype=F32, param_dtype=jnp.float16), True),     # f16 params cast to f32
    (dict(preferred_element_type=F32), True),
    (dict(dtype=BF16, preferred_element_type=F32), True),  # float32 products of bf16 values
    (dict(dtype=jnp.float16), False),
    (dict(precision=jax.lax.Precision.HIGHEST), True),
    (dict(dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k)), False),
    (dict(promote_dtype=lambda args, dtype=None: tuple(
        None if a is None else jnp.asarray(a, BF16) for a in args)), True),
    (dict(promote_dtype=lambda args, dtype=None: tuple(
        None if a is None else jnp.asarray(a, jnp.float16) for a in args)), False),
])
def test_linear_stock_fields(kw, on_kernels):
    ours = jbnnx.Linear(6, 5, rngs=nnx.Rngs(1), **kw)
    stock = nnx.Linear(6, 5, rngs=nnx.Rngs(1), **kw)
    same_state(ours, stock)
    x = normal(0, (3, 6))
    y, want = ours(x), stock(x)
    assert y.dtype == want.dtype
    close(y, want, BF16 if BF16 in (y.dtype, ours.kernel.dtype) or y.dtype == jnp.float16 else F32)
    assert (kernel_calls(ours, x) > 0) == on_kernels


def test_linear_out_sharding_runs_stock():
    ours = jbnnx.Linear(4, 3, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        y = ours(jnp.ones((2, 4)), out_sharding=jax.P(None, None))
    close(y, nnx.Linear(4, 3, rngs=nnx.Rngs(0))(jnp.ones((2, 4))))


def test_linear_metadata_and_checkpoint_interchange():
    ours = jbnnx.Linear(4, 3, rngs=nnx.Rngs(0), kernel_metadata={"tag": "w"})
    assert ours.kernel.get_metadata()["tag"] == "w"
    stock = nnx.Linear(4, 3, rngs=nnx.Rngs(7))
    nnx.update(ours, nnx.state(stock))  # a stock checkpoint loads into ours
    x = normal(0, (2, 4))
    close(ours(x), stock(x))
    assert isinstance(ours, nnx.Linear)


# --- Conv -----------------------------------------------------------------------------------

PADDINGS_2D = ["SAME", "VALID", "CIRCULAR", "REFLECT", "SAME_LOWER", 1, (2, 0),
               ((1, 2), (0, 1)), ((-1, 2), (1, -2)), [(0, 0), 3]]


@pytest.mark.parametrize("padding", PADDINGS_2D, ids=str)
@pytest.mark.parametrize("strides", [1, (2, 3)])
def test_conv2d_every_padding(padding, strides):
    kw = dict(strides=strides, padding=padding)
    ours = jbnnx.Conv(3, 5, (3, 2), rngs=nnx.Rngs(0), **kw)
    stock = nnx.Conv(3, 5, (3, 2), rngs=nnx.Rngs(0), **kw, conv_general_dilated=exact_conv)
    same_state(ours, stock)
    x = normal(1, (2, 9, 7, 3))
    close(ours(x), stock(x))
    assert kernel_calls(ours, x) == 1
    same_grads(ours, stock, x)


def _conv1d_mismatch(got, want, x, layer, padding):
    """Which side of a 1-D convolution mismatch is wrong: both against a float64 NumPy
    convolution (flax's padding forms), with the pixels that differ and the inputs."""
    w, b = (np.asarray(a, np.float64) for a in (layer.kernel.value, layer.bias.value))
    taps = w.shape[0]
    modes = {"CIRCULAR": "wrap", "REFLECT": "reflect"}
    if isinstance(padding, str):
        pads = {"VALID": (0, 0), "CAUSAL": (taps - 1, 0)}.get(padding, ((taps - 1) // 2, taps // 2))
    else:
        pads = (padding, padding) if isinstance(padding, int) else tuple(padding[0])
    xs = np.asarray(x, np.float64)
    xs = xs[:, max(0, -pads[0]):xs.shape[1] - max(0, -pads[1])]
    xs = np.pad(xs, ((0, 0), (max(0, pads[0]), max(0, pads[1])), (0, 0)), mode=modes.get(str(padding), "constant"))
    ref = np.stack([np.einsum("ntc,tco->no", xs[:, p:p + taps], w) for p in range(xs.shape[1] - taps + 1)], 1) + b
    bad = np.argwhere(~np.isclose(got, want, **tol(F32)))
    lines = [f"padding={padding!r}: {len(bad)} of {got.size} outputs differ; x = normal(1, {x.shape}), "
             f"kernel and bias from nnx.Rngs(0); jb {'WRONG' if not np.allclose(got, ref, **tol(F32)) else 'right'}, "
             f"stock {'WRONG' if not np.allclose(want, ref, **tol(F32)) else 'right'} against float64"]
    lines += [f"  [{', '.join(map(str, i))}]: jb {got[tuple(i)]:.7g}, stock {want[tuple(i)]:.7g}, "
              f"float64 {ref[tuple(i)]:.7g}" for i in bad[:12]]
    return "\n".join(lines)


@pytest.mark.parametrize("padding", ["SAME", "VALID", "CAUSAL", "CIRCULAR", "REFLECT", 2,
                                     [(3, 1)], [(-1, 1)]], ids=str)
def test_conv1d_every_padding(padding):
    ours = jbnnx.Conv(4, 3, 3, rngs=nnx.Rngs(0), padding=padding)
    stock = nnx.Conv(4, 3, 3, rngs=nnx.Rngs(0), padding=padding, conv_general_dilated=exact_conv)
    x = normal(1, (2, 11, 4))
    got, want = np.asarray(ours(x)), np.asarray(stock(x))
    if not np.allclose(got, want, **tol(F32)):  # (failed once, unexplained: say who was wrong)
        pytest.fail(_conv1d_mismatch(got, want, x, stock, padding))
    assert kernel_calls(ours, x) == 1
    same_grads(ours, stock, x)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("batch", [(), (2, 3)], ids=["no-batch", "two-batch-dims"])
def test_conv_dtypes_batch_dims_mask_activation(dtype, batch):
    mask = (jnp.arange(3 * 3 * 5 * 7).reshape(3, 3, 5, 7) % 3 != 0).astype(F32)
    kw = dict(dtype=dtype, mask=mask, strides=2)
    ours = jbnnx.Conv(5, 7, (3, 3), rngs=nnx.Rngs(4), activation="relu", **kw)
    stock = nnx.Conv(5, 7, (3, 3), rngs=nnx.Rngs(4), **kw, conv_general_dilated=exact_conv)
    x = normal(2, batch + (7, 6, 5), dtype)
    y = ours(x)
    assert y.dtype == stock(x).dtype and y.shape == stock(x).shape
    close(y, jax.nn.relu(stock(x)), dtype)
    assert kernel_calls(ours, x) == 1
    plain = jbnnx.Conv(5, 7, (3, 3), rngs=nnx.Rngs(4), **kw)
    same_grads(plain, stock, x, dtype)


@pytest.mark.parametrize("kw", [dict(dtype=jnp.float16),
                                dict(conv_general_dilated=lambda *a, **k: jax.lax.conv_general_dilated(*a, **k))],
                         ids=["float16", "custom_conv"])
def test_conv_stock_fallbacks_are_exact(kw):
    ours = jbnnx.Conv(4, 6, (3, 3), rngs=nnx.Rngs(0), **kw)
    stock = nnx.Conv(4, 6, (3, 3), rngs=nnx.Rngs(0), **kw)
    same_state(ours, stock)
    x = normal(1, (2, 8, 8, 4))
    np.testing.assert_array_equal(ours(x), stock(x))
    assert kernel_calls(ours, x) == 0


@pytest.mark.parametrize("kernel_size,kw,x_shape", [
    ((2, 2, 2), dict(feature_group_count=2), (1, 4, 4, 4, 4)),
    ((3, 1, 2), dict(strides=(2, 1, 1), kernel_dilation=(1, 1, 2)), (2, 5, 3, 6, 4)),
    ((3, 3), dict(input_dilation=(1, 2), padding=1, strides=2), (2, 8, 8, 4)),
], ids=["3d_grouped", "3d_strided_dilated", "2d_input_dilation_strided"])
def test_conv_kinds_run_on_the_kernels(kernel_size, kw, x_shape):
    ours = jbnnx.Conv(4, 6, kernel_size, rngs=nnx.Rngs(0), activation="tanh", **kw)
    stock = nnx.Conv(4, 6, kernel_size, rngs=nnx.Rngs(0), **kw, conv_general_dilated=exact_conv)
    same_state(ours, stock)
    x = normal(1, x_shape)
    np.testing.assert_allclose(ours(x), jnp.tanh(stock(x)), atol=2e-5, rtol=2e-5)
    assert kernel_calls(ours, x) > 0


@pytest.mark.parametrize("kw", [dict(strides=2), dict(strides=(1, 3), padding="VALID", kernel_dilation=2),
                                dict(strides=2, padding="CIRCULAR", transpose_kernel=True),
                                dict(strides=2, padding=((2, -1), (0, 1)), use_bias=False)])
def test_conv_transpose_matches_stock(kw):
    ours = jbnnx.ConvTranspose(4, 6, (3, 3), rngs=nnx.Rngs(0), activation="relu", **kw)
    stock = nnx.ConvTranspose(4, 6, (3, 3), rngs=nnx.Rngs(0), **kw)
    same_state(ours, stock)
    x = normal(1, (2, 5, 7, 4))
    np.testing.assert_allclose(ours(x), jax.nn.relu(stock(x)), atol=2e-5, rtol=2e-5)
    assert kernel_calls(ours, x) > 0
    grads = [nnx.grad(lambda m: jnp.sum(jnp.sin(f(m(x)))))(m) for m, f in ((ours, lambda y: y), (stock, jax.nn.relu))]
    for a, b in zip(jax.tree_util.tree_leaves(grads[0]), jax.tree_util.tree_leaves(grads[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


# --- LSTM / RNN -----------------------------------------------------------------------------


def lstm_pair(c, k, **kw):
    cell_kw = {n: kw.pop(n) for n in ("dtype", "param_dtype") if n in kw}
    ours = jbnnx.LSTM(c, k, rngs=nnx.Rngs(5), **cell_kw, **kw)
    stock = nnx.RNN(nnx.OptimizedLSTMCell(c, k, rngs=nnx.Rngs(5), **cell_kw), **kw)
    return ours, stock


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("time_major", [False, True])
def test_lstm_matches_stock(dtype, time_major):
    ours, stock = lstm_pair(7, 9, dtype=dtype, time_major=time_major)
    same_state(ours, stock)
    x = normal(1, (6, 3, 7) if time_major else (3, 6, 7), dtype)
    y, want = ours(x), stock(x)
    assert y.dtype == want.dtype and y.shape == want.shape
    close(y, want, dtype)
    same_state(ours, stock)  # the carry rng stream advanced alike
    carry = stock.cell.initialize_carry((3, 7), nnx.Rngs(0))
    assert kernel_calls(ours, x, initial_carry=carry) >= 1
    same_grads(ours, stock, x, dtype, initial_carry=carry)


def test_lstm_initial_carry_return_carry_reverse_keep_order():
    ours, stock = lstm_pair(5, 4, return_carry=True)
    x = normal(1, (2, 3, 6, 5))  # two batch dims
    carry = (normal(2, (2, 3, 4)), normal(3, (2, 3, 4)))
    for kw in [dict(), dict(reverse=True), dict(reverse=True, keep_order=True),
               dict(return_carry=False)]:
        got, want = ours(x, initial_carry=carry, **kw), stock(x, initial_carry=carry, **kw)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            close(a, b)
    assert kernel_calls(ours, x, initial_carry=carry) >= 1
    same_grads(ours, stock, x, initial_carry=carry)


def test_lstm_seq_lengths():
    ours, stock = lstm_pair(3, 5, reverse=True, keep_order=True)
    x = normal(1, (3, 6, 3))
    lengths = jnp.array([6, 2, 4])
    close(ours(x, seq_lengths=lengths), stock(x, seq_lengths=lengths))
    assert kernel_calls(ours, x, seq_lengths=lengths) >= 1
    # each sequence's own last carry, on the kernels too
    got = ours(x, seq_lengths=lengths, return_carry=True)
    want = stock(x, seq_lengths=lengths, return_carry=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(a, b)
    assert kernel_calls(ours, x, seq_lengths=lengths, return_carry=True) == 1


def test_rnn_takes_rngs_as_stock():
    ours, stock = lstm_pair(3, 4, state_axes={...: nnx.Carry})
    x = normal(1, (2, 5, 3))
    r_ours, r_stock = nnx.Rngs(carry=3), nnx.Rngs(carry=3)
    close(ours(x, rngs=r_ours), stock(x, rngs=r_stock))
    carry = stock.cell.initialize_carry((2, 3), nnx.Rngs(0))
    close(ours(x, rngs=r_ours, initial_carry=carry), stock(x, rngs=r_stock, initial_carry=carry))
    same_state(r_ours, r_stock)
    same_state(ours, stock)
    assert kernel_calls(ours, x, initial_carry=carry) >= 1


@pytest.mark.parametrize("cell_cls", [nnx.LSTMCell, nnx.OptimizedLSTMCell])
def test_rnn_over_stock_cells(cell_cls):
    ours = jbnnx.RNN(cell_cls(4, 6, rngs=nnx.Rngs(0)))
    stock = nnx.RNN(cell_cls(4, 6, rngs=nnx.Rngs(0)))
    same_state(ours, stock)
    x = normal(1, (2, 5, 4))
    close(ours(x), stock(x))
    assert kernel_calls(ours, x, initial_carry=ours.cell.initialize_carry((2, 4), nnx.Rngs(0))) >= 1


@pytest.mark.parametrize("make", [
    lambda: nnx.GRUCell(4, 6, rngs=nnx.Rngs(0)),
    lambda: nnx.LSTMCell(4, 6, gate_fn=jax.nn.hard_sigmoid, rngs=nnx.Rngs(0)),
    lambda: nnx.OptimizedLSTMCell(4, 6, dtype=jnp.float16, rngs=nnx.Rngs(0)),
], ids=["gru", "hard_sigmoid", "float16"])
def test_rnn_other_cells_run_stock(make):
    ours, stock = jbnnx.RNN(make()), nnx.RNN(make())
    x = normal(1, (2, 5, 4))
    np.testing.assert_array_equal(ours(x), stock(x))


def test_lstm_constructor_is_the_stock_cells():
    cell_kw = dict(dtype=BF16, bias_init=nnx.initializers.constant(0.5))
    ours = jbnnx.LSTM(3, 4, rngs=nnx.Rngs(1), carry_rngs=nnx.Rngs(carry=9), time_major=True,
                      unroll=2, **cell_kw)
    stock = nnx.RNN(nnx.OptimizedLSTMCell(3, 4, rngs=nnx.Rngs(1), **cell_kw),
                    rngs=nnx.Rngs(carry=9), time_major=True, unroll=2)
    same_state(ours, stock)
    assert isinstance(ours, nnx.RNN) and type(ours.cell) is nnx.OptimizedLSTMCell
    assert ours.time_major and ours.unroll == 2


# --- transforms -----------------------------------------------------------------------------


def test_nnx_jit_and_train_step():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = jbnnx.Conv(2, 4, (3, 3), rngs=rngs, activation="relu")
            self.lstm = jbnnx.LSTM(4 * 6, 5, rngs=rngs)
            self.head = jbnnx.Linear(5, 3, rngs=rngs)

        def __call__(self, x):
            h = self.conv(x)  # (N, 6, 6, 4): rows as time steps
            return self.head(self.lstm(h.reshape(h.shape[0], 6, 24))[:, -1])

    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, __import__("optax").sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, g)
        return loss

    x = normal(0, (3, 6, 6, 2))
    losses = [float(step(model, optimizer, x)) for _ in range(3)]
    assert losses[2] < losses[0]


def test_vmap():
    layer = jbnnx.Linear(5, 4, rngs=nnx.Rngs(0))
    stock = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
    x = normal(1, (3, 2, 5))
    close(jax.vmap(layer)(x), stock(x))
    close(nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(layer, x), stock(x))

    # a stack of independent layers, one per mapped element (parameters mapped too)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return jbnnx.Linear(5, 4, rngs=nnx.Rngs(key))

    @nnx.vmap(in_axes=0, out_axes=0)
    def make_stock(key):
        return nnx.Linear(5, 4, rngs=nnx.Rngs(key))

    keys = jax.random.split(jax.random.key(0), 3)
    ours, theirs = make(keys), make_stock(keys)
    apply = nnx.vmap(lambda m, x: m(x), in_axes=(0, 0))
    close(apply(ours, x), apply(theirs, x))

    conv = jbnnx.Conv(2, 3, (3, 3), rngs=nnx.Rngs(0))
    xs = normal(2, (4, 2, 5, 5, 2))
    close(jax.vmap(conv)(xs), nnx.Conv(2, 3, (3, 3), rngs=nnx.Rngs(0))(xs))


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make,exc,words", [
    (lambda: jbnnx.Linear(0, 3, rngs=nnx.Rngs(0)), ValueError, "in_features"),
    (lambda: jbnnx.Linear(3, 2.5, rngs=nnx.Rngs(0)), TypeError, "out_features"),
    (lambda: jbnnx.Linear(3, 2, rngs=nnx.Rngs(0), activation="swish"), ValueError, "activation"),
    (lambda: jbnnx.Linear(3, 2, rngs=nnx.Rngs(0), activation=jax.nn.relu), TypeError, "activation"),
    (lambda: jbnnx.Conv(3, 2, (3, 0), rngs=nnx.Rngs(0)), ValueError, "kernel_size"),
    (lambda: jbnnx.Conv(3, 2, (), rngs=nnx.Rngs(0)), ValueError, "kernel_size"),
    (lambda: jbnnx.Conv(3, 2, (3, 3), strides=(1, 2, 3), rngs=nnx.Rngs(0)), ValueError, "strides"),
    (lambda: jbnnx.Conv(3, 2, (3, 3), strides=0, rngs=nnx.Rngs(0)), ValueError, "strides"),
    (lambda: jbnnx.Conv(3, 2, (3, 3), padding="FULL", rngs=nnx.Rngs(0)), ValueError, "padding"),
    (lambda: jbnnx.Conv(3, 2, (3, 3), padding=(1, 2, 3), rngs=nnx.Rngs(0)), ValueError, "padding"),
    (lambda: jbnnx.Conv(3, 2, (3, 3), padding="CAUSAL", rngs=nnx.Rngs(0)), ValueError, "CAUSAL"),
    (lambda: jbnnx.Conv(3, 2, (3, 3), feature_group_count=2, rngs=nnx.Rngs(0)), ValueError,
     "feature_group_count"),
    (lambda: jbnnx.LSTM(3, -1, rngs=nnx.Rngs(0)), ValueError, "hidden_features"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_constructor_errors(make, exc, words):
    with pytest.raises(exc, match=words):
        make()


def test_call_errors():
    with pytest.raises(ValueError, match="in_features = 3"):
        jbnnx.Linear(3, 2, rngs=nnx.Rngs(0))(jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="inputs must be"):
        jbnnx.Conv(3, 2, (3, 3), rngs=nnx.Rngs(0))(jnp.ones((5, 3)))
    with pytest.raises(ValueError, match="in_features = 3"):
        jbnnx.Conv(3, 2, (3, 3), rngs=nnx.Rngs(0))(jnp.ones((1, 5, 5, 4)))
    lstm = jbnnx.LSTM(3, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="inputs must be"):
        lstm(jnp.ones((2, 5, 2)))
    with pytest.raises(ValueError, match="initial_carry"):
        lstm(jnp.ones((2, 5, 3)), initial_carry=(jnp.zeros((2, 4)),))
    with pytest.raises(ValueError, match="initial_carry"):
        lstm(jnp.ones((2, 5, 3)), initial_carry=(jnp.zeros((3, 4)), jnp.zeros((3, 4))))


# --- each sequence's own last carry (seq_lengths with return_carry) --------------------------


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_lstm_seq_lengths_return_carry_and_grads_on_the_kernels(dtype):
    ours, stock = lstm_pair(4, 6, dtype=dtype, return_carry=True, time_major=True)
    x = normal(1, (5, 4, 4), dtype)  # (T, N, C)
    lengths = jnp.array([5, 0, 2, 7])  # 0 and 7: the last step's carry, as stock reads them
    got, want = ours(x, seq_lengths=lengths), stock(x, seq_lengths=lengths)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        close(a, b, dtype)
    assert kernel_calls(ours, x, seq_lengths=lengths) == 1
    same_grads(ours, stock, x, dtype, seq_lengths=lengths)


def test_lstm_seq_lengths_return_carry_errors_and_two_batch_dims():
    ours, stock = lstm_pair(3, 4, return_carry=True)
    x = normal(1, (2, 5, 3))
    with pytest.raises(TypeError, match="jb.nnx.LSTM: seq_lengths must be an integer array"):
        ours(x, seq_lengths=jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="jb.nnx.LSTM: seq_lengths must have shape"):
        ours(x, seq_lengths=jnp.array([1, 2, 3]))
    # two batch dims: stock Flax selects along the first only; the stock scan computes it
    x2, lengths = normal(2, (2, 2, 5, 3)), jnp.array([5, 2])
    for a, b in zip(jax.tree.leaves(ours(x2, seq_lengths=lengths)),
                    jax.tree.leaves(stock(x2, seq_lengths=lengths))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cell_cls", [nnx.OptimizedLSTMCell, nnx.LSTMCell])
def test_accelerate_runs_nnx_rnn_seq_lengths_return_carry_fused(cell_cls):
    rnn = nnx.RNN(cell_cls(3, 5, rngs=nnx.Rngs(0)), return_carry=True, reverse=True,
                  keep_order=True)
    x, lengths = normal(2, (4, 6, 3)), jnp.array([6, 3, 1, 0])
    run = nnx.jit(lambda m, x: m(x, seq_lengths=lengths))
    with jb.accelerate() as acc:
        got, got_grads = run(rnn, x), grads(rnn, x, seq_lengths=lengths)
        calls = kernel_calls(rnn, x, seq_lengths=lengths)
    for a, b in zip(jax.tree.leaves((got, got_grads)),
                    jax.tree.leaves((run(rnn, x), grads(rnn, x, seq_lengths=lengths)))):
        close(a, b, atol=1e-4 * max(1.0, float(jnp.max(jnp.abs(b)))))
    assert calls == 1
    assert acc.calls and all(c.accelerated for c in acc.calls)
