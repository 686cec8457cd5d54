"""jax_brgemm.accelerate() on the Transformer layers of flax.nnx: MultiHeadAttention,
LinearGeneral and Einsum give the stock outputs and gradients with their attention and
projections on the kernels (the custom calls counted in the lowered programs); the
configurations the kernels do not take run stock, and the report says why."""

from __future__ import annotations

import collections
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_brgemm as jb


def normal(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


def close(got, want, tol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.max(np.abs(b)))))


def output_and_gradients(model, **kw):
    """A function of (state, *inputs): the model's output y and the gradients of
    sum(sin(y)) in the state and the first input."""
    graphdef = nnx.graphdef(model)

    def run(state, *inputs):
        y, vjp = jax.vjp(lambda s, x: nnx.merge(graphdef, s)(x, *inputs[1:], **kw),
                         state, inputs[0])
        return y, vjp(jnp.cos(y.astype(jnp.float32)).astype(y.dtype))

    return run


def custom_calls(lowered) -> collections.Counter:
    return collections.Counter(re.findall(r"custom_call @(jb_\w+)", lowered.as_text()))


def lowered(model, *inputs, **kw):
    return jax.jit(output_and_gradients(model, **kw)).lower(nnx.state(model), *inputs)


def check(model, inputs, tol=2e-5, **kw):
    """accelerate()'s output and gradients (state and first input) against stock NNX's;
    returns the context (its calls) and the jb custom calls of the program that ran."""
    state = nnx.state(model)
    want = jax.jit(output_and_gradients(model, **kw))(state, *inputs)
    with jb.accelerate() as acc:
        program = lowered(model, *inputs, **kw)
    close(program.compile()(state, *inputs), want, tol)
    return acc, custom_calls(program)


def mha(*args, **kw):
    return nnx.MultiHeadAttention(*args, decode=False, rngs=nnx.Rngs(0), **kw)


ON_KERNELS = {"jb_fc_fwd": 4, "jb_fc_bwd": 4, "jb_fc_upd": 4, "jb_attention_fwd": 1,
              "jb_attention_bwd": 1}


@pytest.mark.parametrize("case", ["self", "causal-mask", "is-causal", "cross-padding",
                                  "batch-dims-qk-norm", "grouped-kv"])
def test_same_outputs_and_gradients_on_the_kernels(case):
    """Odd sizes, qkv_features and out_features of their own, in_kv_features for cross
    attention, masks, is_causal, two batch dims, normalize_qk and num_kv_heads."""
    x, kw, extra = normal(1, 2, 13, 24), {}, ()
    if case == "self":
        model = mha(3, 24, qkv_features=18, out_features=10)
    elif case == "causal-mask":
        model, kw = mha(4, 24), {"mask": nnx.make_causal_mask(jnp.ones((2, 13)))}
    elif case == "is-causal":
        model, kw = mha(4, 24), {"is_causal": True}
    elif case == "cross-padding":
        model = mha(2, 24, qkv_features=16, in_kv_features=12)
        extra = (normal(2, 2, 7, 12),)
        valid = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 7))
        kw = {"mask": nnx.make_attention_mask(jnp.ones((2, 13)), valid)}
    elif case == "batch-dims-qk-norm":
        model, x = mha(2, 24, normalize_qk=True), normal(1, 2, 3, 5, 24)
    else:
        model = mha(4, 24, num_kv_heads=2)
    acc, calls = check(model, (x, *extra), **kw)
    # the gradient reaches inputs_q only: key and value need no input gradient
    assert calls == ON_KERNELS | ({"jb_fc_bwd": 2} if extra else {})
    assert [(c.path.rsplit("/", 1)[-1], c.accelerated) for c in acc.calls] == [
        ("query", True), ("key", True), ("value", True), ("out", True),
        (acc.calls[-1].path, True)], acc.summary()
    assert acc.calls[-1].layer == "MultiHeadAttention"


def test_bfloat16():
    """dtype=bfloat16 on the kernels against stock bf16 and against float32 on the same
    state (the kernels' softmax is float32, as jax.nn.dot_product_attention's)."""
    x = normal(1, 2, 16, 32)
    model16 = mha(4, 32, dtype=jnp.bfloat16)
    model32 = mha(4, 32)
    acc, calls = check(model16, (x,), tol=3e-2)
    assert calls == ON_KERNELS and all(c.accelerated for c in acc.calls)
    with jb.accelerate():
        y = nnx.jit(lambda m, x: m(x))(model16, x)
    assert y.dtype == jnp.bfloat16
    close(y, model32(x), 3e-2)


def test_under_jax_jit_vmap_and_scan():
    model, x = mha(2, 8), normal(1, 3, 2, 5, 8)
    graphdef, state = nnx.split(model)
    with jb.accelerate() as acc:
        y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
        yv = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(model, x)

        @nnx.scan(in_axes=(None, nnx.Carry), out_axes=nnx.Carry, length=2)
        def twice(m, h):  # the same layer applied twice, under nnx.scan
            return m(h)

        ys = twice(model, x[0])
    close(y, model(x), 2e-5)
    close(yv, model(x), 2e-5)
    close(ys, model(model(x[0])), 2e-5)
    assert acc.calls and all(c.accelerated for c in acc.calls), acc.summary()


def attention_call(acc):
    (call,) = [c for c in acc.calls if c.layer == "MultiHeadAttention"]
    return call


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)':DeprecationWarning")
def test_fallbacks_say_why():
    x = normal(1, 2, 5, 16)
    custom = mha(2, 16, attention_fn=lambda q, k, v, **kw: nnx.dot_product_attention(q, k, v))
    plain = mha(2, 16)
    for model, reason, kw in [(custom, "custom attention_fn", {}),
                              (plain, "attention weights sown", {"sow_weights": True})]:
        want = model(x, **kw)
        with jb.accelerate() as acc:
            got = model(x, **kw)
        close(got, want, 2e-5)
        call = attention_call(acc)
        assert not call.accelerated and call.reason == reason, acc.summary()
        # the projections run on the kernels all the same
        assert all(c.accelerated for c in acc.calls if c.layer == "LinearGeneral")
    assert model.attention_fn is nnx.dot_product_attention  # restored after the call


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_on_the_kernels_drops_what_stock_drops(broadcast):
    x = normal(1, 2, 37, 16)
    model = nnx.MultiHeadAttention(2, 16, dropout_rate=0.5, broadcast_dropout=broadcast, decode=False,
                                   rngs=nnx.Rngs(0))
    twin = nnx.clone(model)  # the same rng state: the same dropout mask
    want = twin(x, deterministic=False)
    with jb.accelerate() as acc:
        got = model(x, deterministic=False)
    close(got, want, 2e-5)
    assert attention_call(acc).accelerated, acc.summary()
    with jb.accelerate() as acc:
        got = model(x, deterministic=True)
    close(got, twin(x, deterministic=True), 2e-5)
    assert attention_call(acc).accelerated


def test_decode_runs_stock():
    model = nnx.MultiHeadAttention(2, 16, decode=True, rngs=nnx.Rngs(0))
    model.init_cache((2, 4, 16))
    twin = nnx.clone(model)
    tokens = normal(1, 2, 3, 16)
    with jb.accelerate() as acc:
        got = [model(tokens[:, t:t + 1]) for t in range(3)]
    close(got, [twin(tokens[:, t:t + 1]) for t in range(3)], 2e-5)
    assert attention_call(acc).reason == "decode (the key / value cache)"


def test_other_threads_and_nested_contexts():
    """A module called in another thread while this one is inside the context computes stock;
    nested contexts record the attention once, in the innermost."""
    model, x = mha(2, 8), normal(1, 2, 5, 8)
    seen, entered, done = {}, threading.Event(), threading.Event()

    def other():
        entered.wait()
        seen["calls"] = custom_calls(lowered(model, x))
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with jb.accelerate() as outer:
        entered.set()
        done.wait()
        with jb.accelerate() as inner:
            here = custom_calls(lowered(model, x))
    thread.join()
    assert not seen["calls"] and here == ON_KERNELS
    assert attention_call(inner).accelerated
    assert not [c for c in outer.calls if c.layer == "MultiHeadAttention"]


def to_bfloat16(arrays, dtype=None):  # a custom promote_dtype, with NNX's signature
    return tuple(None if a is None else a.astype(jnp.bfloat16) for a in arrays)


@pytest.mark.parametrize("make,shape", [
    (lambda: nnx.LinearGeneral(12, (4, 8), rngs=nnx.Rngs(0)), (3, 5, 12)),
    (lambda: nnx.LinearGeneral((5, 3), (2, 3), axis=(1, 2), use_bias=False, rngs=nnx.Rngs(0)),
     (4, 5, 3)),
    (lambda: nnx.LinearGeneral(12, 5, promote_dtype=to_bfloat16, rngs=nnx.Rngs(0)), (3, 12)),
], ids=["heads", "axes-no-bias", "promote-bf16"])
def test_linear_general_taken(make, shape):
    model = make()
    bf16 = model.promote_dtype is to_bfloat16
    acc, calls = check(model, (normal(1, *shape),), tol=3e-2 if bf16 else 2e-5)
    assert calls == {"jb_fc_fwd": 1, "jb_fc_bwd": 1, "jb_fc_upd": 1}
    assert [(c.layer, c.accelerated) for c in acc.calls] == [("LinearGeneral", True)]


def refused(model, x):
    """The calls accelerate() recorded for model(x), after its program had no jb custom call
    and its output was the stock one."""
    with jb.accelerate() as acc:
        got = model(x)
        assert not custom_calls(jax.jit(lambda x: model(x)).lower(x))
    np.testing.assert_array_equal(got, model(x))
    return [(c.accelerated, c.reason) for c in acc.calls]


def _double_dot_general(*args, **kw):
    return 2 * jax.lax.dot_general(*args, **kw)


@pytest.mark.parametrize("make,reason", [
    (lambda: nnx.LinearGeneral(5, 4, axis=1, rngs=nnx.Rngs(0)),
     "contracting axes other than the input's last ones"),
    (lambda: nnx.LinearGeneral(6, 4, batch_axis={0: 3}, rngs=nnx.Rngs(0)), "batch_axis"),
    (lambda: nnx.LinearGeneral(6, 4, dot_general=_double_dot_general, rngs=nnx.Rngs(0)),
     "custom dot_general"),
    (lambda: nnx.LinearGeneral(6, 4, dtype=jnp.float16, rngs=nnx.Rngs(0)), "float16 computation"),
])
def test_linear_general_refused(make, reason):
    assert refused(make(), normal(1, 3, 5, 6)) == [(False, reason)]


def einsum(spec, kernel_shape, bias_shape=None, **kw):
    return nnx.Einsum(spec, kernel_shape, bias_shape, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("make,shape", [
    (lambda: einsum("btd,dnh->btnh", (12, 3, 5), (3, 5)), (2, 7, 12)),
    (lambda: einsum("...nh,nhd->...d", (3, 5, 9), (9,)), (2, 7, 3, 5)),
    (lambda: einsum("btd,hd->bth", (6, 12)), (2, 7, 12)),  # the kernel transposed
    (lambda: einsum("bhd,dhk->bk", (5, 3, 4), (4,)), (2, 3, 5)),  # contracted out of order
    (lambda: einsum("d,dk->k", (12, 5), (5,)), (12,)),
    (lambda: einsum("bd,dk->bk", (12, 5), (5,), dtype=jnp.bfloat16), (3, 12)),
], ids=["heads", "ellipsis", "transposed", "orders", "vector", "bf16"])
def test_einsum_taken(make, shape):
    model = make()
    acc, calls = check(model, (normal(1, *shape),), tol=3e-2 if model.dtype else 2e-5)
    assert calls == {"jb_fc_fwd": 1, "jb_fc_bwd": 1, "jb_fc_upd": 1}
    assert [(c.layer, c.accelerated) for c in acc.calls] == [("Einsum", True)], acc.summary()


@pytest.mark.parametrize("make,shape,reason", [
    (lambda: einsum("btd,dnh->bnth", (12, 3, 5)), (2, 7, 12),
     "output axes other than the input's others, then the features"),
    (lambda: einsum("bdt,dk->btk", (6, 4)), (2, 6, 5),
     "contracting axes other than the input's last ones"),
    (lambda: einsum("btd,bdk->btk", (2, 6, 4)), (2, 5, 6),
     "axes of the input, kernel and output (a batched product)"),
    (lambda: einsum("btd,dk->bk", (6, 4)), (2, 5, 6), "axes summed out of one operand alone"),
    (lambda: einsum("bd,dk->bk", (6, 4), einsum_op=lambda s, *a, **kw: jnp.einsum(s, *a, **kw)),
     (3, 6), "custom einsum_op"),
])
def test_einsum_refused(make, shape, reason):
    assert refused(make(), normal(1, *shape)) == [(False, reason)]


class EncoderBlock(nnx.Module):  # a pre-LayerNorm Transformer encoder block, as people write it
    def __init__(self, features, heads, *, rngs):
        self.norm1 = nnx.LayerNorm(features, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, features, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(features, rngs=rngs)
        self.mlp1 = nnx.Linear(features, 2 * features, rngs=rngs)
        self.mlp2 = nnx.Linear(2 * features, features, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp2(nnx.gelu(self.mlp1(self.norm2(x))))


def test_encoder_block_report():
    model, x = EncoderBlock(16, 2, rngs=nnx.Rngs(0)), normal(1, 2, 9, 16)
    with jb.accelerate(report=True) as acc:
        got = nnx.jit(lambda m, x: m(x))(model, x)
    close(got, model(x), 2e-5)
    summary = acc.summary()
    assert summary.startswith("jax_brgemm.accelerate: 7 of 7 layer calls on the kernels")
    assert "nnx.MultiHeadAttention(2 heads, 16 -> 16)/query [LinearGeneral]: brgemm" in summary
    assert "nnx.Linear(32 -> 16) [Linear]: brgemm" in summary
