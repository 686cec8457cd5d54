"""accelerate()'s contract under jax.jit and its scope: the same jitted function runs stock
before the context, on the kernels inside, stock again after (and the policy switch is part of
the key); flax is exactly itself after the context, and a thread outside it traces stock."""

import subprocess
import sys
import textwrap
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_brgemm as jb

X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)), jnp.float32)


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def _on_kernels(lowered) -> bool:
    return "jb_fc" in lowered.as_text()


def test_the_same_jitted_apply_runs_stock_kernels_stock():
    model = Mlp()
    params = model.init(jax.random.key(0), X)
    apply = jax.jit(model.apply)
    before = apply(params, X)
    assert not _on_kernels(apply.lower(params, X))
    with jb.accelerate(policy=False) as acc:
        inside = apply(params, X)
        assert _on_kernels(apply.lower(params, X))
    assert [c.accelerated for c in acc.calls] == [True, True]
    after = apply(params, X)
    assert not _on_kernels(apply.lower(params, X))
    assert apply._cache_size() == 2  # the stock trace was reused after the context
    np.testing.assert_array_equal(after, before)
    np.testing.assert_allclose(inside, before, rtol=1e-5, atol=1e-5)


def test_traced_inside_first_then_stock_after():
    model = Mlp()
    params = model.init(jax.random.key(0), X)
    apply = jax.jit(model.apply)
    with jb.accelerate(policy=False):
        assert _on_kernels(apply.lower(params, X))
    assert not _on_kernels(apply.lower(params, X))
    with jb.accelerate(policy=False):  # a new context with the same options: the cached trace
        assert _on_kernels(apply.lower(params, X))


@pytest.mark.policy  # the policy's table as this CPU has it
def test_grad_of_a_jitted_function_and_the_policy_switch_are_keyed():
    model = Mlp()
    params = model.init(jax.random.key(0), X)
    grad = jax.jit(jax.grad(lambda p, x: model.apply(p, x).sum()))
    assert not _on_kernels(grad.lower(params, X))
    with jb.accelerate(policy=False):
        assert "jb_fc_upd" in grad.lower(params, X).as_text()
    with jb.accelerate(policy=True):  # float32 dense over 4 rows: the policy keeps it stock
        assert not _on_kernels(grad.lower(params, X))
    with jb.accelerate(policy=False):
        assert _on_kernels(grad.lower(params, X))
    assert not _on_kernels(grad.lower(params, X))


@pytest.mark.policy
def test_policy_default_and_off_are_two_programs():
    model = Mlp()
    params = model.init(jax.random.key(0), X)
    apply = jax.jit(model.apply)
    with jb.accelerate():
        assert not _on_kernels(apply.lower(params, X))
    with jb.accelerate(policy=False):
        assert _on_kernels(apply.lower(params, X))


def _kernel_calls_traced(fn, *args):
    """``(fn(*args), the jb_ kernel calls traced while it ran)``, each target once (a pass's
    ffi_call is made for its primitive's abstract evaluation and again for its lowering)."""
    traced, inner = [], jax.ffi.ffi_call

    def counting(target, *a, **k):
        traced.append(target)
        return inner(target, *a, **k)

    jax.ffi.ffi_call = counting
    try:
        return fn(*args), list(dict.fromkeys(t for t in traced if str(t).startswith("jb_")))
    finally:
        jax.ffi.ffi_call = inner


def test_nnx_jit_and_jax_jit_over_merge_are_keyed():
    layer = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
    call = nnx.jit(lambda m, x: m(x))
    before, traced = _kernel_calls_traced(call, layer, X)
    assert traced == []
    with jb.accelerate(policy=False):
        inside, traced = _kernel_calls_traced(call, layer, X)
    assert traced == ["jb_fc_fwd"]
    after, traced = _kernel_calls_traced(call, layer, X)
    assert traced == []  # the first, stock trace again, from the cache
    np.testing.assert_array_equal(after, before)
    np.testing.assert_allclose(inside, before, rtol=1e-5, atol=1e-5)

    graphdef, state = nnx.split(layer)
    merged = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    assert not _on_kernels(merged.lower(state, X))
    with jb.accelerate(policy=False):
        assert _on_kernels(merged.lower(state, X))
    assert not _on_kernels(merged.lower(state, X))


def test_a_thread_outside_traces_stock_while_another_is_inside():
    model = Mlp()
    params = model.init(jax.random.key(0), X)
    inside, done, seen = threading.Event(), threading.Event(), {}

    def in_context():
        with jb.accelerate(policy=False):
            inside.set()
            done.wait(60)
            seen["inside"] = _on_kernels(jax.jit(model.apply).lower(params, X))

    worker = threading.Thread(target=in_context)
    worker.start()
    assert inside.wait(60)
    try:
        seen["outside"] = _on_kernels(jax.jit(model.apply).lower(params, X))
        layer = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
        seen["outside nnx"] = _kernel_calls_traced(layer, X)[1]
    finally:
        done.set()
        worker.join(60)
    assert seen == {"inside": True, "outside": False, "outside nnx": []}


_SCOPE = textwrap.dedent('''
    import functools
    import flax.linen as nn
    import flax.nnx as nnx
    import jax, jax.numpy as jnp

    def snapshot():
        classes = {nn.Module, nnx.Module}
        for namespace in (nn, nnx, nn.recurrent, nnx.nn.recurrent, nnx.nn.linear, nnx.nn.attention):
            classes |= {v for v in vars(namespace).values() if isinstance(v, type)}
        return {c: dict(vars(c)) for c in classes}

    def same(a, b):
        # flax rewrites a class's __dataclass_fields__ whenever a subclass of it is defined
        changed = [f"{c.__name__}.{k}" for c in a for k in set(a[c]) | set(b[c])
                   if a[c].get(k, None) is not b[c].get(k, None) and k != "__dataclass_fields__"]
        assert not changed, changed

    first = snapshot()
    import jax_brgemm as jb
    same(first, snapshot())

    class Scanned(nn.Module):
        @functools.partial(nn.transforms.scan, variable_broadcast="params", in_axes=1,
                           out_axes=1, split_rngs={"params": False})
        @nn.compact
        def __call__(self, carry, x):
            return nn.OptimizedLSTMCell(4)(carry, x)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.MultiHeadDotProductAttention(2)(x)
            x = nn.RNN(nn.OptimizedLSTMCell(4))(x)
            carry = nn.OptimizedLSTMCell(4).initialize_carry(jax.random.key(0), x[:, 0].shape)
            return nn.Dense(3)(Scanned()(carry, x)[1])

    x = jnp.ones((2, 5, 4))
    net = Net()
    params = net.init(jax.random.key(0), x)
    mha = nnx.MultiHeadAttention(2, 4, 4, decode=False, rngs=nnx.Rngs(0))
    rnn = nnx.RNN(nnx.OptimizedLSTMCell(4, 4, rngs=nnx.Rngs(0)))
    with jb.accelerate(policy=False) as acc:
        class Inside(nn.Module):  # a class defined inside the context
            @nn.compact
            def __call__(self, x):
                return nn.Dense(2)(x)
        jax.jit(net.apply)(params, x)
        mha(x), rnn(x)
        Inside().init_with_output(jax.random.key(0), x)
    assert sum(c.accelerated for c in acc.calls) >= 6, acc.summary()
    assert mha.attention_fn is nnx.dot_product_attention
    same(first, snapshot())
    assert "__call__" in vars(Scanned) and vars(Scanned)["__call__"].__name__ == "__call__"
    print("unchanged")
''')


def test_flax_is_itself_after_import_and_after_the_context():
    """In a fresh process: every attribute of flax's layer classes and nn.Module is the same
    object after importing jax_brgemm and after a context that traced linen, NNX, scanned
    models and defined a module class."""
    run = subprocess.run([sys.executable, "-c", _SCOPE], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "unchanged" in run.stdout, run.stderr[-3000:]
