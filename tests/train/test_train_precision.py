"""--precision: the brgemm run traces its steps under the requested matmul precision, logs it
(and what was computed) and passes the checker; stock XLA, which ignores precision on CPU,
refuses it."""

import json

import pytest
from tiny_benchmark import only_set, read_events

from jax_brgemm.train import SUITE
from jax_brgemm.train.config import SetConfig, UsageError, check


def test_bf16_3x_run_logs_its_precision_and_passes_the_checker(tiny):
    """With the switch off (the tests' default) the run computes exact float32 and says so."""
    log_dir = tiny.root / "logs" / "bf16_3x"
    code = tiny.main("tiny", "--impl", "brgemm", "--precision", "bf16_3x", "--data-dir",
                     str(tiny.data), "--log-dir", str(log_dir))
    assert code == 0
    log_dir = only_set(log_dir)
    assert tiny.passes_checker(log_dir / "result_0.txt")
    events = read_events(log_dir / "result_0.txt")
    exact = dict.fromkeys(("dense", "conv", "attention", "lstm"), "float32")
    assert [e["value"] for e in events if e["key"] == "matmul_precision"] == [
        {"requested": "bf16_3x", "computed": "float32", "computed_by_op": exact}]
    assert json.loads((log_dir / "config.json").read_text())["precision"] == "bf16_3x"


@pytest.mark.parametrize("precision,message", [("bf16", "applies to --impl brgemm only"),
                                               ("tf32", "must be one of")])
def test_refused_for_stock_xla_and_unknown_names(precision, message):
    with pytest.raises(UsageError, match=message):
        check(SetConfig(SUITE["mlp"], impl="xla", precision=precision))


def test_emulated_bf16_3x_run_takes_the_generic_step_and_passes_the_checker(tiny, monkeypatch):
    """With the emulation on (JAX_BRGEMM_EMULATE=1) the run computes bf16_3x, says so, and
    takes optax's step after the gradients (the fused updates compute exact fp32 products)."""
    from jax_brgemm import precision
    from jax_brgemm.train import fused, loop

    monkeypatch.setattr(precision, "EMULATE", True)
    taken = []
    real = loop.train_step_for
    monkeypatch.setattr(loop, "train_step_for", lambda *a, **k: taken.append(real(*a, **k).func) or real(*a, **k))
    log_dir = tiny.root / "logs" / "bf16_3x_emulated"
    assert tiny.main("tiny", "--impl", "brgemm", "--precision", "bf16_3x", "--data-dir", str(tiny.data),
                     "--log-dir", str(log_dir)) == 0
    log_dir = only_set(log_dir)
    assert tiny.passes_checker(log_dir / "result_0.txt")
    events = read_events(log_dir / "result_0.txt")
    emulated = dict.fromkeys(("dense", "conv", "attention", "lstm"), "bf16_3x")
    assert [e["value"] for e in events if e["key"] == "matmul_precision"] == [
        {"requested": "bf16_3x", "computed": "bf16_3x", "computed_by_op": emulated}]
    assert taken and fused.train_step not in taken
