"""The peak probe that every "fraction of peak" figure is measured against."""

import jax_brgemm as jb


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
    assert all(v > 1.0 for v in peak.values()), peak  # at least a GFLOP/s on any AVX2 core
    # bf16 widened exactly to fp32 runs at the FMA rate: the bf16 ceiling is never below it.
    assert peak["bfloat16"] == max(v for k, v in peak.items() if k != "bfloat16")
