"""The bf16 emulation of float32 products (ops/emulation.py, JAX_BRGEMM_EMULATE=1): its
error against a float64 reference is within 16x of exact float32's with three products and
2x with six (one product is bf16's), over reductions of 256 to 65,536 products, odd sizes,
zeros, subnormals and large magnitudes; its gradients are emulated to the same accuracy;
bfloat16 inputs and the default stay exact."""

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
BOUND = {"bf16_3x": 16, "bf16_6x": 2}


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(precision, "EMULATE", True)


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


@pytest.mark.parametrize("batch,m,k,n", [(1, 8, 256, 16), (4, 5, 1024, 3), (2, 9, 32768, 7), (1, 3, 65536, 2)])
def test_reductions_within_the_bounds(emulate, batch, m, k, n):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((batch, m, k)).astype(np.float32)
    b = rng.standard_normal((batch, k, n)).astype(np.float32)
    err = errors(a, b)
    for name, factor in BOUND.items():
        assert err[name] <= factor * err["float32"], err
    assert err["bf16"] < 2e-2, err  # one product: bf16's rounding, not float32's


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


@pytest.mark.parametrize("accuracy", ["bf16_3x", "bf16_6x"])
def test_dense_and_its_gradients_are_emulated(emulate, accuracy):
    rng = np.random.default_rng(2)
    # every reduction (forward, dx, dw) over at least 256 products, as the bounds are stated
    x = rng.standard_normal((259, 300)).astype(np.float32)
    w = (rng.standard_normal((300, 257)) / 20).astype(np.float32)
    b = rng.standard_normal(257).astype(np.float32)
    cot = rng.standard_normal((259, 257))
    f = jax.jit(lambda x, w, b: jb.dense(x, w, b, activation="tanh", precision=PRESET[accuracy]))
    assert "jb_brgemm" in f.lower(x, w, b).as_text()  # the emulation, not the fp32 FC passes
    y64 = np.tanh(x.astype(np.float64) @ w + b)
    dz = cot * (1 - y64 ** 2)
    want = (dz @ w.T, x.T.astype(np.float64) @ dz, dz.sum(0))
    grads = jax.grad(lambda *p: jnp.sum(f(*p) * cot), argnums=(0, 1, 2))(x, w, b)
    exact = jax.grad(lambda *p: jnp.sum(jb.dense(*p, activation="tanh") * cot), argnums=(0, 1, 2))(x, w, b)
    assert rel_error(f(x, w, b), y64) <= BOUND[accuracy] * max(rel_error(jb.dense(x, w, b, activation="tanh"), y64),
                                                               1e-7)
    for g, e, ref in zip(grads, exact, want, strict=True):
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


def test_without_the_switch_every_request_is_exact_float32():
    assert not precision.EMULATE  # the test run's default (CI sets nothing)
    a = jnp.ones((1, 3, 8))
    lowered = jax.jit(lambda a: jb.brgemm(a, a.swapaxes(-1, -2), precision="high")).lower(a).as_text()
    assert "bf16" not in lowered
