"""The peak probe that every "fraction of peak" figure is measured against."""

import os
import time

import jax
import jax.numpy as jnp
import pytest

import jax_brgemm as jb

# The GEMMs run at most this far above the probe's figure before the test calls the probe
# wrong: timing noise on shared cores, not a tolerance of the probe.
NOISE = 0.8
ROUNDS = 3


def test_peak_gflops_reports_the_units_this_cpu_has():
    peak = jb.peak_gflops(seconds=0.02, repeats=1)
    isa = jb.isa()
    if isa == "generic":
        assert peak == {}
        return
    want = {"float32", "bfloat16"}
    want |= {"bfloat16_vdpbf16ps"} if isa in ("avx512", "amx") else set()
    want |= {"bfloat16_amx"} if isa == "amx" else set()
    assert set(peak) == want
    # bf16 widened exactly to fp32 runs at the FMA rate: the bf16 ceiling is never below it.
    assert peak["bfloat16"] == max(v for k, v in peak.items() if k != "bfloat16")
    # No core does more than 64 fp32 FMA flops a cycle (two 512-bit FMA units) at 6 GHz.
    assert 0 < peak["float32"] <= (os.cpu_count() or 1) * 64 * 6.0, peak
    if isa == "amx":  # a tile multiply does many times the work of a vector FMA
        assert peak["bfloat16_amx"] > 2 * peak["float32"], peak


def _best_gflops(fn, args, flops, calls=4):
    """The fastest of ``calls`` timed calls, in GFLOP/s: noise only ever slows a call."""
    jax.block_until_ready(fn(*args))  # compile, warm up
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return flops / best / 1e9


def _gemms(dtype, n=1024):
    """GFLOP/s of an (n x n) @ (n x n) product on the kernels and in XLA, the faster."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (1, n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (1, n, n), jnp.float32).astype(dtype)
    flops = 2.0 * n ** 3
    ours = _best_gflops(jax.jit(jb.brgemm), (a, b), flops)
    xla = _best_gflops(jax.jit(lambda a, b: jnp.dot(a[0], b[0], preferred_element_type=jnp.float32)),
                       (a, b), flops)
    return max(ours, xla)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_is_above_what_a_large_gemm_reaches(dtype):
    """The probe's ceiling for ``dtype`` (bf16: any multiply path, fp32 accumulation) is at
    least what a large GEMM reaches on the same machine, on the kernels or in XLA: a probe
    that under-counts (one thread, half-width vectors, a wrong flop count) fails this.

    Rounds alternate the probe and the GEMMs; the best round's ratio counts, so a round in
    which other processes slowed the probe more than the GEMMs does not decide."""
    if jb.isa() == "generic":
        pytest.skip("no probe without AVX2")
    ratios = []
    for _ in range(ROUNDS):
        ceiling = jb.peak_gflops(seconds=0.05, repeats=3)[dtype]
        reached = _gemms(jnp.dtype(dtype))
        ratios.append(ceiling / reached)
        if ratios[-1] >= NOISE:
            break
    assert max(ratios) >= NOISE, (dtype, ratios)
