"""The harness against the MLPerf training rules, on tiny generated data.

Seeds (1), the RCP check (2), cache clearing (4), kept result sets (5), normalization
on the same CPU (6), what a reviewer needs in the log (7), the init time limit (8) and
bad command lines (9). Optimizer equivalence (3) is tests/train/test_train_optim.py.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
from tiny_benchmark import mutate, only_set, read_events

from jax_brgemm.train import data, rcp, report, scoring
from jax_brgemm.train.summary import reference_result


def _main(tiny, *args):
    return tiny.main("tiny", "--impl", "xla", "--data-dir", str(tiny.data), *args)


def _record_reference(tiny, epochs_to_target, batch_size=64, cpu="Some CPU"):
    """A reference/tiny.json whose runs reach the target after the given epochs."""
    runs = [{"seed": i, "accuracies": [0.5] * (e - 1) + [0.99] * (4 - e + 1),
             "times": [10.0 * (k + 1) for k in range(4)], "losses": [1.0] * 4}
            for i, e in enumerate(epochs_to_target)]
    reference = {"benchmark": "tiny", "impl": "xla", "dtype": "float32", "division": "closed",
                 "hparams": {"global_batch_size": batch_size}, "machine": cpu,
                 "cpu_model": cpu, "runs": runs}
    (tiny.reference / "tiny.json").write_text(json.dumps(reference))


# --------------------------------------------------------------------------- 1 seeds


def test_closed_division_refuses_a_fixed_seed(tiny, tmp_path, capsys):
    code = _main(tiny, "--seed", "11", "--log-dir", str(tmp_path / "logs"))
    err = capsys.readouterr().err
    assert code == 2 and "[rule closed/seed]" in err and "--division open" in err
    assert not (tmp_path / "logs").exists()


def test_open_division_seed_reproduces_and_logs_its_source(tiny, tmp_path):
    for _ in range(2):
        assert _main(tiny, "--division", "open", "--seed", "11", "--log-dir",
                     str(tmp_path / "logs")) == 0
    sets = sorted((tmp_path / "logs").iterdir())
    summaries = [json.loads((s / "summary.json").read_text()) for s in sets]
    assert [r["seed"] for r in summaries[0]["runs"]] == [11]
    assert summaries[0]["runs"][0]["seed_source"] == "--seed 11 + run index 0"
    assert [e["accuracy"] for e in summaries[0]["runs"][0]["evals"]] == \
        [e["accuracy"] for e in summaries[1]["runs"][0]["evals"]]  # same seed, same run
    seed = next(e for e in read_events(sets[0] / "result_0.txt") if e["key"] == "seed")
    assert seed["value"] == 11 and seed["metadata"]["source"] == "--seed 11 + run index 0"
    assert "jax.random.key(seed)" in seed["metadata"]["uses"]
    assert tiny.passes_checker(sets[0] / "result_0.txt")  # a fixed seed is fine when open


# --------------------------------------------------------------------------- 2 RCP


@pytest.fixture(scope="module")
def full_set(tiny):
    """A full closed-division set (5 runs) against a reference that converges in 4
    epochs every time: the tiny runs (about 2 epochs) are faster than it allows."""
    _record_reference(tiny, [4, 4, 4, 4, 4])
    log_dir = tiny.root / "logs" / "full"
    code = _main(tiny, "--runs", "5", "--log-dir", str(log_dir))
    set_dir = only_set(log_dir)
    yield code, set_dir, json.loads((set_dir / "summary.json").read_text())
    (tiny.reference / "tiny.json").unlink(missing_ok=True)


def test_rcp_failure_rejects_the_result(full_set):
    code, set_dir, summary = full_set
    assert all(r["status"] == "success" and r["compliance"] for r in summary["runs"])
    assert summary["rcp"]["status"] == "fail"
    assert "mlperf_logging RCP checker" in summary["rcp"]["message"]
    assert "the result is rejected" in summary["rcp"]["message"]
    assert summary["score"]["valid"] is False and summary["score"]["value"] is None
    assert "RCP check fail" in summary["score"]["reason"] and not summary["official"]
    assert code == 1
    assert (set_dir / "rcps_tiny.json").is_file() and (set_dir / "rcp_checker.log").is_file()
    assert not (set_dir / "scaling.json").exists()


def test_rcp_scaled_pass_writes_scaling_json_and_scales_the_score(tiny, full_set):
    _, set_dir, summary = full_set
    _record_reference(tiny, [1, 2, 3, 4, 4])  # mean 3, wide spread: faster but allowed
    verdict = rcp.check(tiny.bench, set_dir, 5, "closed")
    epochs = sorted(r["epochs"] for r in summary["runs"])
    mean = sum(epochs[1:-1]) / 3
    assert verdict["status"] == "pass" and verdict["scaling_factor"] == pytest.approx(3 / mean)
    assert "scaled by" in verdict["message"] and "rejected" not in verdict["message"]
    assert json.loads((set_dir / "scaling.json").read_text()) == {
        "scaling_factor": pytest.approx(3 / mean)}
    raw = scoring.olympic_mean([r["time_to_train"] for r in summary["runs"]])
    scaled = scoring.apply_rcp(raw, verdict)
    assert scaled.valid and scaled.value == pytest.approx(raw.value * 3 / mean)


def test_rcp_pass_without_scaling_and_missing_rcp(tiny, full_set):
    _, set_dir, _ = full_set
    _record_reference(tiny, [1, 1, 1, 1, 1])  # slower than the tiny runs: plain pass
    verdict = rcp.check(tiny.bench, set_dir, 5, "closed")
    assert verdict["status"] == "pass" and verdict["scaling_factor"] == 1.0
    assert "not scaled" in verdict["message"] and "rejected" not in verdict["message"]
    assert not (set_dir / "scaling.json").exists()
    _record_reference(tiny, [1, 1, 1, 1, 1], batch_size=32)  # an RCP for another batch size
    assert rcp.check(tiny.bench, set_dir, 5, "closed")["status"] == "missing"
    (tiny.reference / "tiny.json").unlink()
    verdict = rcp.check(tiny.bench, set_dir, 5, "closed")
    assert verdict["status"] == "missing" and "no reference convergence point" in \
        verdict["message"]
    assert not scoring.apply_rcp(scoring.olympic_mean([1.0, 2.0, 3.0]), verdict).valid


def test_rcp_gives_no_verdict_for_a_single_run_or_the_open_division(tiny, full_set):
    _, set_dir, _ = full_set
    single = rcp.check(tiny.bench, set_dir, 1, "closed")
    assert single["status"] == "no verdict" and "pass" not in single["message"]
    assert rcp.check(tiny.bench, set_dir, 5, "open")["status"] == "n/a"


# --------------------------------------------------------------------------- 4 cache


def test_log_says_the_cache_was_cleared_as_mincore_saw_it(full_set):
    _, set_dir, _ = full_set
    event = next(e for e in read_events(set_dir / "result_0.txt") if e["key"] == "cache_clear")
    assert event["value"] is True and event["metadata"]["cached_pages"] == 0
    assert event["metadata"]["pages"] > 0 and "mincore" in event["metadata"]["method"]


@pytest.mark.skipif(data.in_memory_filesystem("/dev/shm") != "tmpfs", reason="no tmpfs /dev/shm")
def test_data_on_tmpfs_is_refused(tiny, tmp_path, capsys):
    ram = Path("/dev/shm") / f"jax_brgemm_test_{os.getpid()}"
    shutil.copytree(tiny.data, ram)
    try:
        code = tiny.main("tiny", "--impl", "xla", "--data-dir", str(ram),
                         "--log-dir", str(tmp_path / "logs"))
    finally:
        shutil.rmtree(ram)
    err = capsys.readouterr().err
    assert code == 2 and "is on tmpfs, in RAM" in err and not (tmp_path / "logs").exists()


# --------------------------------------------------------------------------- 5 sets


def test_each_invocation_writes_a_new_set_and_deletes_nothing(tiny, tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "result_0.txt").write_text("an earlier log\n")
    (log_dir / "summary.json").write_text("{}\n")
    assert _main(tiny, "--log-dir", str(log_dir)) == 0
    first = only_set(log_dir)
    before = {p: p.read_bytes() for p in first.iterdir()}
    assert _main(tiny, "--log-dir", str(log_dir)) == 0
    sets = sorted(p for p in log_dir.iterdir() if p.is_dir())
    assert len(sets) == 2 and sets[0] == first
    assert {p: p.read_bytes() for p in first.iterdir()} == before  # untouched
    assert (log_dir / "result_0.txt").read_text() == "an earlier log\n"
    summary = json.loads((sets[1] / "summary.json").read_text())
    assert summary["set"] == str(sets[1])
    assert {"result_0.txt", "compliance_0.log", "config.json", "summary.json",
            "accuracy.png"} <= {p.name for p in sets[1].iterdir()}


# --------------------------------------------------------------------------- 6 normalization


def test_normalization_only_against_the_same_cpu_kind(tiny, tmp_path, capsys):
    bench = tiny.bench
    _record_reference(tiny, [2, 2, 2, 2, 2], cpu="Another CPU")
    try:
        assert _main(tiny, "--impl", "brgemm", "--log-dir", str(tmp_path / "brgemm")) == 0
        out = capsys.readouterr().out
        summary = json.loads((only_set(tmp_path / "brgemm") / "summary.json").read_text())
        assert summary["reference"]["result"] is not None
        assert summary["reference"]["same_cpu"] is False and summary["normalized_score"] is None
        assert "WARNING: no normalized score" in out and "Another CPU" in out
        # The same reference recorded on this CPU kind normalizes.
        sibling = {"benchmark": "tiny", "division": "closed", "dtype": "float32", "set": "s",
                   "cpu_model": summary["cpu_model"], "cpu_kind": summary["cpu_kind"],
                   "score": {"value": 5.0, "valid": True}, "runs": []}
        reference = reference_result(bench, "brgemm", "closed", "float32", sibling,
                                     summary["cpu_kind"])
        assert reference["same_cpu"] and reference["result"] == 5.0
    finally:
        (tiny.reference / "tiny.json").unlink()


# --------------------------------------------------------------------------- 7 log contents


def test_log_has_what_a_reviewer_needs(full_set, tiny):
    _, set_dir, summary = full_set
    events = read_events(set_dir / "result_0.txt")
    value = {e["key"]: e["value"] for e in events}
    assert {"jax", "jaxlib", "flax", "optax", "jax_brgemm"} <= set(value["framework_versions"])
    assert all(value["framework_versions"][k] for k in ("jax", "jaxlib", "flax", "optax"))
    assert value["git_commit"]
    assert value["host_cpus"]["usable_cpus"] >= 1 and value["host_cpus"]["logical_cpus"] >= 1
    assert value["config_filename"] == "config.json"
    config = json.loads((set_dir / "config.json").read_text())
    assert config["hparams"] == summary["hparams"] and config["benchmark"] == "tiny"
    run = summary["runs"][0]
    losses = [e for e in events if e["key"] == "train_loss"]
    assert [e["metadata"]["epoch_num"] for e in losses] == list(range(1, run["epochs"] + 1))
    for e in (e for e in events if e["key"] == "eval_accuracy"):
        assert e["metadata"]["samples_count"] == e["metadata"]["epoch_num"] * 512
        assert e["metadata"]["eval_samples"] == 300
    assert not {"lowest_numerical_precision_in_attn", "lowest_numerical_precision_in_comm",
                "opt_learning_rate_decay_poly_power"} & set(value)


def test_open_division_summary_has_the_geometric_mean_of_final_quality(tiny, tmp_path, capsys):
    assert _main(tiny, "--division", "open", "--runs", "2", "--log-dir", str(tmp_path)) == 0
    summary = json.loads((only_set(tmp_path) / "summary.json").read_text())
    final = [r["evals"][-1]["accuracy"] for r in summary["runs"]]
    assert summary["final_quality_geomean"] == pytest.approx((final[0] * final[1]) ** 0.5)
    assert "geometric mean of the final quality" in capsys.readouterr().out


def test_polynomial_schedule_logs_its_power_and_passes_the_checker(tiny, tmp_path):
    hp = _hparams(tmp_path, {"opt_learning_rate_decay_schedule": "polynomial",
                             "opt_learning_rate_decay_poly_power": 1.5})
    assert _main(tiny, "--hparams", hp, "--log-dir", str(tmp_path / "logs")) == 0
    set_dir = only_set(tmp_path / "logs")
    events = read_events(set_dir / "result_0.txt")
    assert [e["value"] for e in events if e["key"] == "opt_learning_rate_decay_poly_power"] == [1.5]
    assert json.loads((set_dir / "config.json").read_text())["hparams_file"] == hp
    assert tiny.passes_checker(set_dir / "result_0.txt")


# --------------------------------------------------------------------------- 8 init time


def _init_lasting(minutes, division):
    """An edit making the init phase last ``minutes`` (later events shifted with it)."""
    state = {"shift": 0}

    def edit(e):
        if e["key"] == "submission_division":
            e = {**e, "value": division}
        if e["key"] == "init_stop":
            start = state["init_start"]
            state["shift"] = start + minutes * 60_000 - e["time_ms"]
        if e["key"] == "init_start":
            state["init_start"] = e["time_ms"]
        return {**e, "time_ms": e["time_ms"] + state["shift"]}
    return edit


@pytest.mark.parametrize("minutes, division, passes", [
    (29, "closed", True), (31, "closed", False), (31, "open", True), (239, "open", True),
    (241, "open", False)])
def test_init_phase_over_the_limit_fails_the_check(tiny, full_set, tmp_path, minutes, division,
                                                  passes):
    _, set_dir, _ = full_set
    log = mutate(set_dir / "result_0.txt", tmp_path / "result_0.txt",
                  _init_lasting(minutes, division))
    assert tiny.passes_checker(log) is passes


# --------------------------------------------------------------------------- 9 bad input


def _hparams(tmp_path, obj):
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.mark.parametrize("args", [
    lambda t: ["--hparams", _hparams(t, {"opt_name": ["sgd"]})],
    lambda t: ["--hparams", _hparams(t, {"opt_name": {"sgd": 1}})],
    lambda t: ["--hparams", _hparams(t, {"global_batch_size": [64]})],
    lambda t: ["--hparams", _hparams(t, {"opt_learning_rate_decay_poly_power": 2.0})],
    lambda t: ["--log-dir", "/proc/x"],
    lambda t: ["--log-dir", str(t / "a_file")],
    lambda t: ["--log-dir", ""],
    lambda t: ["--seed", "18446744073709551616"],
    lambda t: ["--division", "open", "--seed", "18446744073709551616"],
    lambda t: ["--division", "open", "--seed", "4294967295", "--runs", "2"],
    lambda t: ["--data-dir", "/nonexistent"],
    lambda t: ["--log-dir", str(t / "logs" / "brgemm"), "--impl", "brgemm"],  # bad sibling
], ids=["opt_name list", "opt_name dict", "batch list", "poly_power with cosine",
        "log-dir /proc", "log-dir file", "log-dir empty", "seed 2**64 closed",
        "seed 2**64 open", "seed + runs over 32 bits", "data-dir missing", "bad sibling"])
def test_bad_input_is_one_line_and_exit_2_with_nothing_trained(tiny, tmp_path, capsys,
                                                               monkeypatch, args):
    (tmp_path / "a_file").write_text("not a directory\n")
    sibling = tmp_path / "logs" / "xla" / "20260101-000000"
    sibling.mkdir(parents=True)
    (sibling / "summary.json").write_text(json.dumps({"benchmark": "tiny", "score": {}}))
    (tmp_path / "result_0.txt").write_text("an earlier log\n")
    monkeypatch.chdir(tmp_path)  # --log-dir "" must not touch the current directory
    argv = ["tiny", "--impl", "xla", "--data-dir", str(tiny.data), *args(tmp_path)]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    code = tiny.main(*argv)
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written or deleted


def test_malformed_summary_names_the_file(tmp_path):
    path = tmp_path / "s" / "summary.json"
    path.parent.mkdir()
    path.write_text('{"benchmark": "mlp"}')
    with pytest.raises(report.SummaryError, match="not a summary this harness writes"):
        report.latest_summary(tmp_path)
    path.write_text("{broken")
    with pytest.raises(report.SummaryError, match="cannot read it as JSON"):
        report.latest_summary(tmp_path)
