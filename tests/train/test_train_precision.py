"""--precision: the brgemm run traces its steps under the requested matmul precision, logs it
(and what was computed) and passes the checker; stock XLA, which ignores precision on CPU,
refuses it."""

import json

import pytest
from tiny_benchmark import only_set, read_events

from jax_brgemm.train import SUITE
from jax_brgemm.train.config import SetConfig, UsageError, check


def test_bf16_3x_run_logs_its_precision_and_passes_the_checker(tiny):
    log_dir = tiny.root / "logs" / "bf16_3x"
    code = tiny.main("tiny", "--impl", "brgemm", "--precision", "bf16_3x", "--data-dir",
                     str(tiny.data), "--log-dir", str(log_dir))
    assert code == 0
    log_dir = only_set(log_dir)
    assert tiny.passes_checker(log_dir / "result_0.txt")
    events = read_events(log_dir / "result_0.txt")
    assert [e["value"] for e in events if e["key"] == "matmul_precision"] == [
        {"requested": "bf16_3x", "computed": "float32"}]
    assert json.loads((log_dir / "config.json").read_text())["precision"] == "bf16_3x"


@pytest.mark.parametrize("precision,message", [("bf16", "applies to --impl brgemm only"),
                                               ("tf32", "must be one of")])
def test_refused_for_stock_xla_and_unknown_names(precision, message):
    with pytest.raises(UsageError, match=message):
        check(SetConfig(SUITE["mlp"], impl="xla", precision=precision))
