"""The machine's arithmetic ceiling, measured: what "fraction of peak" is measured against."""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _native

# name -> probe unit: fp32 FMA (zmm, or ymm on AVX2), AVX-512 bf16 pair dot products, AMX
# bf16 tiles.
_UNITS = {"float32": "fma", "bfloat16_vdpbf16ps": "vdpbf16ps", "bfloat16_amx": "amx"}


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn().block_until_ready()
    return time.perf_counter() - t0


def peak_gflops(seconds: float = 0.3, repeats: int = 7) -> dict[str, float]:
    """GFLOP/s of independent register (or AMX tile) chains on all of XLA's threads, with
    no memory traffic: the median over ``repeats`` runs of about ``seconds`` each.

    Keys: ``"float32"`` (FMA), ``"bfloat16_vdpbf16ps"`` on AVX-512 and, where the CPU has
    AMX, ``"bfloat16_amx"``; ``"bfloat16"`` is the ceiling of a bf16 multiply with fp32
    accumulation by any path: the best bf16 unit, or the FMA on operands widened exactly to
    fp32 where that is faster (an Intel Xeon without AMX: ``vdpbf16ps`` at half the FMA
    rate; AVX2: the FMA is the only path). Empty without AVX2 (the generic kernel).
    """
    isa = _native.isa()
    if isa == "generic":
        return {}
    items = 4 * max(1, os.cpu_count() or 1)  # several items per thread: balanced finish
    peak = {}
    for name, unit in _UNITS.items():
        if (unit == "amx" and isa != "amx") or (unit == "vdpbf16ps" and isa == "avx2"):
            continue

        def probe(iters):
            call = jax.ffi.ffi_call("jb_peak_probe", jax.ShapeDtypeStruct((items,), jnp.float32))
            return jax.jit(lambda: call(iters=np.int64(iters), unit=unit))

        short = probe(2000)
        short().block_until_ready()  # compile
        iters = max(1000, int(2000 * seconds / max(_seconds(short), 1e-6)))
        fn = probe(iters)
        fn().block_until_ready()
        flops = items * iters * _native.peak_flops_per_iter(unit)
        peak[name] = statistics.median(flops / _seconds(fn) / 1e9 for _ in range(repeats))
    peak["bfloat16"] = max(peak.values())
    return peak
