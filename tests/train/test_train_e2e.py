"""End to end on small generated IDX data: runs, MLPerf logs, the official checker."""

import dataclasses
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from mlperf_logging.compliance_checker import mlp_compliance

from jax_brgemm.train import cli, compliance, data, rulegen, suite
from jax_brgemm.train.compliance import compliance_config

NAMES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
         "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}


def _write_tiny_data(directory: Path) -> data.Dataset:
    """An easy 10-class problem: class c brightens rows 2c..2c+2 of a noisy image."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 512), ("test", 300)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 200, (n, 28, 28))
        for i, c in enumerate(labels):
            images[i, 2 * c:2 * c + 3, :] += 50
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels
    directory.mkdir(parents=True)
    files = {}
    for role, array in arrays.items():
        array = array.astype(np.uint8)
        payload = bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
        payload += array.tobytes()
        (directory / (NAMES[role] + ".gz")).write_bytes(gzip.compress(payload))
        files[role] = data.IdxFile(NAMES[role], hashlib.sha256(payload).hexdigest(), array.shape)
    # The checksums of this generated data: a Dataset spec is data, set from code only.
    return dataclasses.replace(data.FASHION_MNIST, name="tiny", files=files, mirrors=(),
                               system_dir=None, system_package=None)


def _tiny_model(impl, dtype):
    from jax_brgemm.models import MLP

    return MLP(features=(32,), num_classes=10, impl=impl, dtype=dtype)


def _tiny_benchmark(dataset, name="tiny", target=0.8):
    mlp = suite.SUITE["mlp"]
    # Learning rate 0.05: every seed reaches the target at epoch 2 (0 of 140 random seeds
    # failed, brgemm and xla); at 0.2, 3 of 40 diverged, and the closed division's tests
    # draw their seeds from system randomness.
    common = {**mlp.hparams["common"], "global_batch_size": 64, "opt_base_learning_rate": 0.05,
              "opt_learning_rate_warmup_epochs": 0.5, "opt_learning_rate_decay_epochs": 4.0}
    return dataclasses.replace(mlp, name=name, description="tiny test MLP", dataset=dataset,
                               model=_tiny_model, target=target, max_epochs=4,
                               eval_batch_size=128, hparams={**mlp.hparams, "common": common})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Registers the tiny benchmarks (and their generated rules) for the module's tests."""
    root = tmp_path_factory.mktemp("tiny")
    dataset = _write_tiny_data(root / "data")
    benches = [_tiny_benchmark(dataset), _tiny_benchmark(dataset, "tiny_never", target=1.01)]
    rules = root / "rules"
    rules.mkdir()
    shutil.copy(compliance.RULES_DIR / "common.yaml", rules)
    with pytest.MonkeyPatch.context() as mp:
        for bench in benches:
            (rules / f"{bench.name}.yaml").write_text(rulegen.render(bench))
            mp.setitem(suite.SUITE, bench.name, bench)
        mp.setattr(compliance, "RULES_DIR", rules)
        mp.delenv(data.ENV_VAR, raising=False)
        yield {"data": root / "data", "root": root}


def _events(log_path):
    lines = Path(log_path).read_text().splitlines()
    assert all(line.startswith(":::MLLOG ") for line in lines), "log has non-MLLOG lines"
    return [json.loads(line[len(":::MLLOG "):]) for line in lines]


def _checker(log_path) -> bool:
    checker = mlp_compliance.make_checker("training", "6.1.0", quiet=False, werror=False)
    return mlp_compliance.main(str(log_path), compliance_config("tiny"), checker)[0]


def only_set(log_dir: Path) -> Path:
    """The one set directory an invocation wrote into LOG_DIR."""
    (set_dir,) = [p for p in log_dir.iterdir() if p.is_dir()]
    return set_dir


@pytest.fixture(scope="module")
def xla_run(tiny):
    """Three closed-division runs, seeds from system randomness; (exit code, set dir)."""
    log_dir = tiny["root"] / "logs" / "xla"
    code = cli.main(["tiny", "--impl", "xla", "--runs", "3",
                     "--data-dir", str(tiny["data"]), "--log-dir", str(log_dir)])
    return code, only_set(log_dir)


def test_tiny_runs_reach_target_and_pass_the_official_checker(tiny, xla_run):
    code, log_dir = xla_run
    assert code == 0
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["set"] == str(log_dir)
    assert len({r["seed"] for r in summary["runs"]}) == 3
    assert all(r["seed_source"] == cli.SYSTEM_SEED_SOURCE for r in summary["runs"])
    assert all(r["status"] == "success" and r["compliance"] for r in summary["runs"])
    assert summary["score"]["method"] == "olympic" and summary["score"]["valid"]
    times = sorted(r["time_to_train"] for r in summary["runs"])
    assert summary["score"]["value"] == pytest.approx(times[1])
    # 3 of the 5 runs of a full set: the RCP check gives no verdict (and no "pass").
    assert summary["rcp"]["status"] == "no verdict" and not summary["official"]
    assert (log_dir / "accuracy.png").stat().st_size > 0
    # The command line, run as a user would.
    proc = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker",
                           "--config", compliance_config("tiny"), "--log_output",
                           str(log_dir / "check.log"), str(log_dir / "result_0.txt")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# Required by the official rules of every benchmark, but meaningless here (no attention,
# no communication): not logged rather than logged with a placeholder value.
NOT_APPLICABLE = {"lowest_numerical_precision_in_attn", "lowest_numerical_precision_in_comm"}


def _required_official_keys():
    """Keys the official 6.1 training rules require of every benchmark, but those that
    do not apply here."""
    import mlperf_logging.compliance_checker as cc

    rules = Path(cc.__file__).parent / "training_6.1.0"
    required, either = set(), []
    for name in ("common.yaml", "closed_common.yaml"):
        for record in yaml.safe_load((rules / name).read_text()):
            key = record.get("KEY")
            if not key or "REQ" not in key or key["REQ"] == "OPTIONAL":
                continue
            if key["REQ"].startswith("AT_LEAST_ONE_OR("):
                either.append({key["NAME"], key["REQ"][len("AT_LEAST_ONE_OR("):-1].strip()})
            else:
                required.add(key["NAME"])
    return required - NOT_APPLICABLE, either


def test_log_contents(xla_run):
    _, log_dir = xla_run
    events = _events(log_dir / "result_1.txt")
    keys = [e["key"] for e in events]
    required, either = _required_official_keys()
    assert required - set(keys) == set() and not NOT_APPLICABLE & set(keys)
    assert all(alternatives & set(keys) for alternatives in either)
    hp = suite.SUITE["tiny"].hparams
    for key in [*hp["common"], *hp["sgd"], "seed", "model_impl"]:
        assert keys.count(key) == 1, key
    value = {e["key"]: e["value"] for e in events}
    summary = json.loads((log_dir / "summary.json").read_text())
    assert value["seed"] == summary["runs"][1]["seed"] and value["submission_division"] == "closed"
    assert value["submission_benchmark"] == "tiny" and value["model_impl"] == "xla"
    assert value["global_batch_size"] == 64 and value["train_samples"] == 512
    # MLPerf order: init, cache_clear, run_start, then epochs; run_stop last.
    order = [keys.index(k) for k in ("init_start", "init_stop", "cache_clear", "run_start",
                                     "epoch_start")]
    assert order == sorted(order) and keys[-1] == "run_stop"
    epochs = [e["metadata"]["epoch_num"] for e in events if e["key"] == "epoch_start"]
    assert epochs == list(range(1, len(epochs) + 1))
    evals = [e for e in events if e["key"] == "eval_accuracy"]
    assert [e["metadata"]["epoch_num"] for e in evals] == epochs
    assert evals[-1]["value"] >= 0.8 > max([e["value"] for e in evals[:-1]], default=0)
    assert events[-1]["metadata"]["status"] == "success"


def _mutate(src, dst, edit):
    """Writes ``src``'s events through ``edit`` (an event -> None to drop it, one event,
    or a list of events) to ``dst``."""
    events = []
    for e in (edit(e) for e in _events(src)):
        events += e if isinstance(e, list) else [e] if e is not None else []
    dst.write_text("".join(":::MLLOG " + json.dumps(e) + "\n" for e in events))
    return dst


def _set(key, value, index=0):
    seen = {"n": 0}

    def edit(e):
        if e["key"] == key:
            seen["n"] += 1
            if seen["n"] == index + 1:
                return {**e, "value": value} if value != "DROP" else None
        return e
    return edit


def _meta(key, field, value):
    def edit(e):
        if e["key"] == key:
            return {**e, "metadata": {**e["metadata"], field: value}}
        return e
    return edit


@pytest.mark.parametrize("edit", [
    _set("seed", "DROP"),
    _set("global_batch_size", "DROP"),
    _set("sgd_opt_momentum", "DROP"),
    _set("opt_base_learning_rate", 5.0),
    _set("opt_name", "rmsprop"),
    _set("sgd_opt_nesterov", 1),
    _set("train_samples", 60000),
    _set("submission_benchmark", "resnet"),
    _set("cache_clear", "DROP"),
    _set("epoch_start", "DROP"),  # epoch 1: every run has it
    _meta("epoch_start", "epoch_num", 0),
    _meta("run_stop", "status", "done"),
    _set("run_start", "DROP"),
    lambda e: {**e, "value": 0.5} if e["key"] == "eval_accuracy" else e,
    # issue 14: seeds, cache clearing, what a reviewer needs, schedule keys
    _meta("seed", "source", "--seed 11 + run index 0"),
    _set("cache_clear", False),
    _meta("cache_clear", "cached_pages", 3),
    _meta("eval_accuracy", "samples_count", 10),
    _meta("eval_accuracy", "eval_samples", 100),
    lambda e: None if e["key"] == "train_loss" else e,
    _set("framework_versions", "DROP"),
    _set("git_commit", "DROP"),
    _set("host_cpus", "DROP"),
    _set("config_filename", "suite defaults"),
    lambda e: [e, {**e, "key": "opt_learning_rate_decay_poly_power", "value": 2.0}] if e[
        "key"] == "opt_learning_rate_decay_schedule" else e,
], ids=lambda f: getattr(f, "__qualname__", "edit"))
def test_checker_rejects_broken_logs(xla_run, tmp_path, edit):
    _, log_dir = xla_run
    assert _checker(log_dir / "result_0.txt")
    assert not _checker(_mutate(log_dir / "result_0.txt", tmp_path / "result_0.txt", edit))


def test_open_division_lifts_hyperparameter_constraints(xla_run, tmp_path):
    _, log_dir = xla_run
    log = _mutate(log_dir / "result_0.txt", tmp_path / "a.txt", _set("opt_base_learning_rate", 5.0))
    assert not _checker(log)
    log = _mutate(log, tmp_path / "b.txt", _set("submission_division", "open"))
    assert _checker(log)


def test_aborted_bfloat16_run_exit_1_and_seed_from_system(tiny, capsys):
    log_dir = tiny["root"] / "logs" / "never"
    code = cli.main(["tiny_never", "--impl", "xla", "--max-epochs", "1", "--dtype", "bfloat16",
                     "--data-dir", str(tiny["data"]), "--log-dir", str(log_dir)])
    out = capsys.readouterr().out
    assert code == 1
    log_dir = only_set(log_dir)
    events = _events(log_dir / "result_0.txt")
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["status"] == "aborted"
    assert [e["metadata"]["epoch_num"] for e in events if e["key"] == "eval_accuracy"] == [1]
    seed = next(e["value"] for e in events if e["key"] == "seed")
    assert {"key": "lowest_numerical_precision_in_linear", "value": "bfloat16"}.items() <= \
        next(e for e in events if e["key"] == "lowest_numerical_precision_in_linear").items()
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["runs"][0]["seed"] == seed and summary["score"]["valid"] is False
    # Not reaching the target fails the checker, as with the official rules.
    assert summary["runs"][0]["compliance"] is False and "FAILED" in out
    assert "epoch   1" in out and "accuracy" in out  # progress went to the terminal


def test_brgemm_impl_end_to_end(tiny):
    log_dir = tiny["root"] / "logs" / "brgemm"
    code = cli.main(["tiny", "--impl", "brgemm", "--data-dir",
                     str(tiny["data"]), "--log-dir", str(log_dir)])
    assert code == 0
    log_dir = only_set(log_dir)
    assert _checker(log_dir / "result_0.txt")
    assert any(e["key"] == "model_impl" and e["value"] == "brgemm"
               for e in _events(log_dir / "result_0.txt"))


def test_reference_result_prefers_sibling_xla_runs():
    bench = suite.SUITE["mlp"]
    recorded_cpu = bench.reference()["cpu_model"]
    sibling = {"benchmark": "mlp", "division": "closed", "dtype": "float32", "set": "runs/x/1",
               "cpu_model": "CPU A", "score": {"value": 123.0, "valid": True}, "runs": []}
    reference = cli.reference_result(bench, "brgemm", "closed", "float32", sibling, "CPU A")
    assert reference == {"result": 123.0, "source": "xla runs in runs/x/1", "cpu_model": "CPU A",
                         "same_cpu": True}
    # Another dtype: the sibling's runs do not apply, the recorded reference runs do.
    reference = cli.reference_result(bench, "brgemm", "closed", "bfloat16", sibling,
                                     recorded_cpu)
    assert reference["source"] == "recorded xla reference runs (src/jax_brgemm/train/reference/mlp.json)"
    assert reference["result"] == bench.reference_summary()["result"].value
    assert reference["same_cpu"] is True
