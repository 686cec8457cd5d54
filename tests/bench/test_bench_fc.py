"""bench/bench_fc.py runs end to end on a tiny grid, emulated precisions included: its table
prints and its results file holds every contender's row."""

import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow  # ~30 s: compiles every contender
def test_bench_fc_with_precisions_prints_and_writes(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # bench_fc imports its neighbour common
    common = importlib.import_module("common")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_fc = importlib.import_module("bench_fc")
    monkeypatch.setattr(bench_fc.precision, "EMULATE", bench_fc.precision.EMULATE)  # main() sets it
    bench_fc.main(["--tiny", "--repeats", "1", "--min-time", "0", "--precisions", "bf16_3x", "bf16"])
    table = capsys.readouterr().out
    assert "| float32 | 8 | 32 | step |" in table and "| bfloat16 | 8 | 32 | step |" in table
    result = json.loads((tmp_path / "fc_precisions.json").read_text())
    f32 = [r for r in result["layer"] if r["dtype"] == "float32"]
    assert f32 and all({"jax_brgemm_bf16_3x", "jax_brgemm_bf16"} <= set(r["gflops"]) for r in f32)
    mlp = [r for r in result["mlp"] if r["dtype"] == "float32"]
    assert mlp and all("jax_brgemm_bf16_3x" in r["seconds"] for r in mlp)
