"""bench/bench_fc.py runs end to end on a tiny grid, emulated precisions included: its table
prints and its results file holds every contender's row."""

import json

import pytest


@pytest.mark.slow  # ~30 s: compiles every contender
def test_bench_fc_with_precisions_prints_and_writes(bench, tmp_path, capsys):
    bench("bench_fc").main(["--tiny", "--repeats", "1", "--min-time", "0", "--precisions", "bf16_3x", "bf16"])
    table = capsys.readouterr().out
    assert "| float32 | 8 | 32 | step |" in table and "| bfloat16 | 8 | 32 | step |" in table
    result = json.loads((tmp_path / "fc_precisions.json").read_text())
    f32 = [r for r in result["layer"] if r["dtype"] == "float32"]
    assert f32 and all({"jax_brgemm_bf16_3x", "jax_brgemm_bf16"} <= set(r["gflops"]) for r in f32)
    mlp = [r for r in result["mlp"] if r["dtype"] == "float32"]
    assert mlp and all("jax_brgemm_bf16_3x" in r["seconds"] for r in mlp)
