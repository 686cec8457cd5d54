"""jb.brgemm against stock JAX: values, gradients, transformations, bad input."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_brgemm as jb

F32, BF16 = jnp.float32, jnp.bfloat16


def reference(a, b, c=None, out_dtype=F32):
    out = jnp.einsum("...bmk,...bkn->...mn", a.astype(F32), b.astype(F32),
                     precision=jax.lax.Precision.HIGHEST)
    if c is not None:
        out = out + c.astype(F32)
    return out.astype(out_dtype)


def operands(shape_a, shape_b, dtype, seed=0):
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(ka, shape_a, F32).astype(dtype),
            jax.random.normal(kb, shape_b, F32).astype(dtype))


def tol(dtype, k_total):
    # fp32: accumulation-order differences grow with the reduction length.
    # bf16 inputs are exact in fp32 products; bf16 outputs round to 8 bits.
    return dict(rtol=2e-2, atol=2e-2 * np.sqrt(k_total)) if dtype == BF16 else \
        dict(rtol=1e-5, atol=1e-5 * np.sqrt(k_total))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 9), M=st.integers(1, 40), K=st.integers(1, 40), N=st.integers(1, 70),
       bf16=st.booleans(), with_c=st.booleans(), lead=st.sampled_from([(), (2,), (3, 1)]))
def test_matches_einsum(B, M, K, N, bf16, with_c, lead):
    dtype = BF16 if bf16 else F32
    a, b = operands(lead + (B, M, K), lead + (B, K, N), dtype, seed=B * 1000 + M * 7 + N)
    c = jax.random.normal(jax.random.PRNGKey(3), lead + (M, N), F32) if with_c else None
    got = jax.jit(jb.brgemm)(a, b, c)
    assert got.shape == lead + (M, N) and got.dtype == F32
    np.testing.assert_allclose(got, reference(a, b, c), **tol(F32, B * K))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (32, 64, 64, 64), (3, 17, 33, 15), (2, 5, 1, 129)])
def test_bf16_inputs_exact_fp32_accumulation(shape):
    B, M, K, N = shape
    a, b = operands((B, M, K), (B, K, N), BF16)
    got = jb.brgemm(a, b)
    np.testing.assert_allclose(got, reference(a, b), rtol=1e-5, atol=1e-5 * np.sqrt(B * K))


def test_out_dtype_bfloat16_and_bf16_accumulator():
    a, b = operands((4, 9, 19), (4, 19, 23), BF16)
    got = jb.brgemm(a, b, out_dtype=BF16)
    assert got.dtype == BF16
    np.testing.assert_allclose(got.astype(F32), reference(a, b).astype(BF16).astype(F32),
                               rtol=1e-2, atol=1e-2)
    c = jnp.ones((9, 23), BF16)
    got = jb.brgemm(a, b, c)  # out dtype follows c
    assert got.dtype == BF16
    np.testing.assert_allclose(got.astype(F32), reference(a, b, c).astype(F32), rtol=2e-2, atol=5e-2)


def test_leading_dims_broadcast():
    a, _ = operands((3, 1, 2, 5, 6), (1,), F32)
    _, b = operands((1,), (4, 2, 6, 7), F32, seed=1)
    c = jnp.arange(5 * 7, dtype=F32).reshape(5, 7)
    got = jb.brgemm(a, b, c)
    assert got.shape == (3, 4, 5, 7)
    np.testing.assert_allclose(got, reference(a, b, c), rtol=1e-5, atol=1e-4)


def grad_operands(m, k, n, dtype, with_c):
    """a (2, 3, m, k) and b (1, 3, k, n) in dtype, c (m, n) or None, the loss weights
    w (2, m, n), and the argnums to differentiate (c's too when it is given)."""
    a, b = operands((2, 3, m, k), (1, 3, k, n), dtype)
    c = jax.random.normal(jax.random.PRNGKey(5), (m, n), F32) if with_c else None
    w = jax.random.normal(jax.random.PRNGKey(9), (2, m, n), F32)
    return a, b, c, w, (0, 1, 2) if with_c else (0, 1)


def assert_grads_match(got, want, inputs, **tols):
    """Each gradient has its input's shape and dtype and matches the reference's."""
    for g, r, x in zip(got, want, inputs[:len(got)], strict=True):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(g.astype(F32), r.astype(F32), **tols)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_c", [False, True])
def test_grads_match_jax_grad_of_einsum(dtype, with_c):
    a, b, c, w, argnums = grad_operands(13, 17, 11, dtype, with_c)

    def loss(fn, a, b, c):
        return jnp.sum(w * fn(a, b, c))

    got = jax.jit(jax.grad(lambda *x: loss(jb.brgemm, *x), argnums))(a, b, c)
    want = jax.grad(lambda *x: loss(reference, *x), argnums)(a, b, c)
    assert_grads_match(got, want, (a, b, c), **tol(dtype, 3 * 17))


def test_first_order_of_a_sum_of_squares():
    a, b = operands((2, 4, 5), (2, 5, 3), F32)
    f = lambda a: jnp.sum(jb.brgemm(a, b) ** 2)
    r = lambda a: jnp.sum(reference(a, b) ** 2)
    np.testing.assert_allclose(jax.grad(f)(a), jax.grad(r)(a), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0), (1, 2)])
def test_vmap(in_axes):
    a, b = operands((5, 3, 7, 9), (5, 3, 9, 4), F32)
    a = a if in_axes[0] != 1 else jnp.moveaxis(a, 0, 1)
    b = b if in_axes[1] != 2 else jnp.moveaxis(b, 0, 2)
    a = a[0] if in_axes[0] is None else a
    b = b[0] if in_axes[1] is None else b
    got = jax.jit(jax.vmap(jb.brgemm, in_axes=in_axes))(a, b)
    want = jax.vmap(reference, in_axes=in_axes)(a, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_vmap_does_not_materialize_unbatched_operand():
    a, b = operands((8, 2, 6, 7), (2, 7, 5), F32)
    hlo = jax.jit(jax.vmap(jb.brgemm, in_axes=(0, None))).lower(a, b).as_text()
    call = next(line for line in hlo.splitlines() if "custom_call @jb_brgemm" in line)
    # b reaches the kernel with a size-1 leading dim, broadcast in place, never copied 8x.
    assert "tensor<1x2x7x5xf32>" in call and "8x2x7x5" not in hlo


def test_grad_under_vmap_with_shared_c():
    a, b = operands((4, 2, 3, 5), (4, 2, 5, 6), F32)
    c = jnp.ones((3, 6), F32)
    f = lambda a, b, c: jnp.sum(jb.brgemm(a, b, c) ** 2)
    r = lambda a, b, c: jnp.sum(reference(a, b, c) ** 2)
    got = jax.vmap(jax.grad(f, (0, 1, 2)), in_axes=(0, 0, None))(a, b, c)
    want = jax.vmap(jax.grad(r, (0, 1, 2)), in_axes=(0, 0, None))(a, b, c)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)
    # and the grad of a vmapped function sums the shared c's cotangent
    gc = jax.grad(lambda c: jnp.sum(jax.vmap(f, (0, 0, None))(a, b, c)))(c)
    wc = jax.grad(lambda c: jnp.sum(jax.vmap(r, (0, 0, None))(a, b, c)))(c)
    np.testing.assert_allclose(gc, wc, rtol=1e-5, atol=1e-4)


def test_nan_and_inf_propagate():
    a, b = operands((2, 4, 5), (2, 5, 6), F32)
    a = a.at[1, 2, 3].set(jnp.nan).at[0, 0, 0].set(jnp.inf)
    got = np.asarray(jb.brgemm(a, b))
    want = np.asarray(reference(a, b))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[2]).all() and not np.isnan(got[1]).any()
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))


def test_repeated_calls_are_bitwise_identical():
    a, b = operands((16, 96, 80), (16, 80, 120), F32)
    f = jax.jit(jb.brgemm)
    first = np.asarray(f(a, b))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(f(a, b)), first)


@pytest.mark.parametrize("a_shape,b_shape,c_shape,err,match", [
    ((4, 5), (4, 5, 6), None, ValueError, "rank >= 3"),
    ((2, 4, 5), (3, 5, 6), None, ValueError, "batch B or"),
    ((2, 4, 5), (2, 6, 6), None, ValueError, "reduced size K"),
    ((2, 4, 5), (2, 5, 6), (4, 7), ValueError, r"\(\.\.\., M, N\)"),
    ((3, 2, 4, 5), (4, 2, 5, 6), None, ValueError, "do not broadcast"),
])
def test_bad_shapes(a_shape, b_shape, c_shape, err, match):
    a, b = jnp.zeros(a_shape, F32), jnp.zeros(b_shape, F32)
    c = None if c_shape is None else jnp.zeros(c_shape, F32)
    with pytest.raises(err, match=match):
        jb.brgemm(a, b, c)


def test_bad_dtypes():
    x = jnp.zeros((2, 3, 4), F32)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        jb.brgemm(x.astype(jnp.float16), x.astype(jnp.float16).swapaxes(1, 2))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        jb.brgemm(x.astype(jnp.int32), x.swapaxes(1, 2).astype(jnp.int32))
    with pytest.raises(TypeError, match="one dtype"):
        jb.brgemm(x, x.swapaxes(1, 2).astype(BF16))
    with pytest.raises(TypeError, match="out_dtype=bfloat16"):
        jb.brgemm(x, x.swapaxes(1, 2), out_dtype=BF16)
    with pytest.raises(TypeError, match="c has dtype float32 but out_dtype is bfloat16"):
        jb.brgemm(x.astype(BF16), x.swapaxes(1, 2).astype(BF16), jnp.zeros((3, 3), F32), out_dtype=BF16)
    with pytest.raises(TypeError, match="out_dtype must be float32 or bfloat16"):
        jb.brgemm(x, x.swapaxes(1, 2), out_dtype=jnp.float16)


def test_bad_accumulator_dtype_blames_c():
    """A bf16 c with fp32 a and b: the message is about c, not an out_dtype never passed."""
    x = jnp.zeros((2, 3, 4), F32)
    with pytest.raises(TypeError, match="c has dtype bfloat16") as e:
        jb.brgemm(x, x.swapaxes(1, 2), c=jnp.zeros((3, 3), BF16))
    assert "out_dtype" not in str(e.value)
    with pytest.raises(TypeError, match="c must be float32 or bfloat16"):
        jb.brgemm(x, x.swapaxes(1, 2), c=jnp.zeros((3, 3), jnp.float16))


# --- sizes of zero: what jnp.einsum gives ------------------------------------------------------

@pytest.mark.parametrize("shape_a,shape_b,c_shape", [
    ((0, 2, 4, 5), (0, 2, 5, 3), None),     # a 0-size leading dim
    ((2, 0, 3), (2, 3, 4), (0, 4)),         # M = 0
    ((2, 3, 0), (2, 0, 4), (3, 4)),         # K = 0: c (or zeros)
    ((0, 3, 5), (0, 5, 4), (3, 4)),         # B = 0: nothing to reduce
    ((1, 3, 5), (1, 5, 0), None),           # N = 0
    ((1, 1, 3, 5), (0, 1, 5, 4), None),     # broadcast against an empty leading dim
])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_zero_sizes_like_einsum(shape_a, shape_b, c_shape, dtype):
    a, b = operands(shape_a, shape_b, dtype)
    c = None if c_shape is None else jnp.ones(c_shape, F32)
    got = jax.jit(jb.brgemm)(a, b, c)
    want = reference(a, b, c)
    assert got.shape == want.shape and got.dtype == F32
    np.testing.assert_allclose(got, want)
    args = (a, b) if c is None else (a, b, c)
    g = jax.grad(lambda *x: jnp.sum(jb.brgemm(*x) ** 2), tuple(range(len(args))))(*args)
    r = jax.grad(lambda *x: jnp.sum(reference(*x) ** 2), tuple(range(len(args))))(*args)
    for gi, ri, x in zip(g, r, args, strict=True):
        assert gi.shape == x.shape and gi.dtype == x.dtype
        np.testing.assert_allclose(gi.astype(F32), ri.astype(F32), rtol=1e-5)


# --- grad of grad ------------------------------------------------------------------------------

def penalized(fn, w):
    """sum(w * fn) plus the squared norm of its gradient w.r.t. a: a second-order loss."""
    def loss(a, b, c):
        value, da = jax.value_and_grad(lambda a: jnp.sum(w * fn(a, b, c).astype(F32)))(a)
        return value + jnp.sum(da.astype(F32) ** 2)
    return loss


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_c", [False, True])
def test_grad_of_grad_matches_stock(dtype, with_c):
    a, b, c, w, argnums = grad_operands(6, 7, 5, dtype, with_c)
    got = jax.jit(jax.grad(penalized(jb.brgemm, w), argnums))(a, b, c)
    want = jax.grad(penalized(reference, w), argnums)(a, b, c)
    tols = dict(rtol=5e-2, atol=0.5) if dtype == BF16 else dict(rtol=1e-4, atol=1e-4)
    assert_grads_match(got, want, (a, b, c), **tols)


def test_grad_of_grad_runs_on_the_kernel():
    a, b = operands((3, 4, 5), (3, 5, 6), F32)
    w = jnp.ones((4, 6), F32)
    hlo = jax.jit(jax.grad(penalized(jb.brgemm, w), (0, 1))).lower(a, b, None).compile().as_text()
    assert "jb_brgemm" in hlo and " dot(" not in hlo


# --- the ISA ---------------------------------------------------------------------------------

ISAS = ("generic", "avx2", "avx512", "amx")  # lowest first


def cpu_isa():
    """The best ISA the CPU's flags allow, from /proc/cpuinfo."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= flags:
        return "amx" if {"amx_bf16", "amx_tile"} <= flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "generic"


def isa_in_subprocess(value):
    env = {k: v for k, v in os.environ.items() if k != "JAX_BRGEMM_ISA"}
    if value is not None:
        env["JAX_BRGEMM_ISA"] = value
    return subprocess.run([sys.executable, "-c", "import jax_brgemm; print(jax_brgemm.isa())"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_isa_matches_the_cpu_flags():
    if "JAX_BRGEMM_ISA" in os.environ:
        pytest.skip("JAX_BRGEMM_ISA is set for this run")
    want = cpu_isa()
    # AMX also needs the OS's permission for the tile state; a CPU with the flags but
    # without that permission runs the AVX-512 kernels.
    assert jb.isa() == want or (want == "amx" and jb.isa() == "avx512")


def test_isa_override_lowers():
    best = ISAS.index(isa_in_subprocess(None).stdout.strip())
    for value in ISAS:
        run = isa_in_subprocess(value)
        assert run.returncode == 0, run.stderr
        # a lower value is taken as it is; one higher than the CPU has is lowered to it
        assert run.stdout.strip() == ISAS[min(ISAS.index(value), best)], value


@pytest.mark.parametrize("value", ["avx9000", "AVX2"])
def test_bad_isa_is_one_clear_error_at_import(value):
    run = isa_in_subprocess(value)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: JAX_BRGEMM_ISA='{value}' is not a kernel ISA")
    assert all(name in last for name in ISAS)
    assert "During handling" not in run.stderr  # one error, not one raised inside another


def test_long_batch_reduce_is_as_accurate_as_xla():
    # 1M products of a nonzero mean per output: summed in chunks, not one register chain.
    rng = np.random.default_rng(1)
    a, b = rng.random((256, 4, 4096), np.float32), rng.random((256, 4096, 4), np.float32)
    ref = np.einsum("bmk,bkn->mn", a.astype(np.float64), b.astype(np.float64))
    errors = [np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(ref)
              for out in (jax.jit(jb.brgemm)(a, b), jax.jit(lambda a, b: jnp.einsum("bmk,bkn->mn", a, b))(a, b))]
    assert errors[0] <= max(8 * errors[1], 1e-6), errors
