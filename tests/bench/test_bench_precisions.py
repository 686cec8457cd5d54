"""bench/bench_precisions.py runs end to end on one family: its table prints a row and its
results file holds every accuracy's speed-up over exact float32."""

import json


def test_bench_precisions_prints_and_writes(bench, tmp_path, capsys):
    bench("bench_precisions").main(["--families", "dense", "--repeats", "2", "--min-time", "0"])
    assert "| dense |" in capsys.readouterr().out
    (row,) = json.loads((tmp_path / "precisions.json").read_text())["rows"]
    assert row["family"] == "dense" and set(row["vs_float32"]) == {"bf16_6x", "bf16_3x", "bf16"}
    assert all(s["median"] > 0 and s["range"][0] <= s["median"] <= s["range"][1] for s in row["vs_float32"].values())
