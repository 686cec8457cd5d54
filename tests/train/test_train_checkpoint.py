"""Checkpoints, resume and clean interruption, on tiny generated data.

A reference run trains the tiny benchmark for all its epochs (target 1.01: never
reached); the other runs are killed (SIGKILL), interrupted (SIGINT / SIGTERM) or left
with an unfinished checkpoint, then resumed, and must reproduce its evaluations bit for
bit. Runs that get a signal run in a subprocess (tests/train/harness_driver.py), slowed
down per batch so that the signal lands in the middle of an epoch.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_benchmark import newest_set, only_set, read_events, read_summary, write_rules

from jax_brgemm.train import checkpoint

NAME = "tiny_never"
SEED = ["--division", "open", "--seed", "7"]
DRIVER = Path(__file__).resolve().parent / "harness_driver.py"
STEP_SLEEP = 0.06  # seconds per batch in killed runs: 8 batches, ~0.5 s per epoch


@pytest.fixture(scope="module")
def never(tiny):
    """The tiny benchmark that trains all 4 epochs, its rules rendered for a target these
    runs reach, so that the checker judges the logs' structure (resumed or not)."""
    write_rules(tiny.suite.rules_dir, [dataclasses.replace(tiny.never, target=0.5)])
    return tiny


def _evals(summary):
    return [(e["epoch"], e["accuracy"], e["loss"]) for e in summary["runs"][0]["evals"]]


@pytest.fixture(scope="module")
def reference(never):
    """The uninterrupted run: its evaluations (epoch, accuracy, train loss)."""
    log_dir = never.root / "logs" / "reference"
    assert never.main(NAME, *SEED, "--data-dir", str(never.data), "--log-dir", str(log_dir)) == 1
    summary = read_summary(only_set(log_dir))
    assert [e[0] for e in _evals(summary)] == [1, 2, 3, 4]
    return _evals(summary)


def _start(tiny, log_dir, *args):
    env = {**os.environ, "STEP_SLEEP": str(STEP_SLEEP)}
    return subprocess.Popen(
        [sys.executable, str(DRIVER), str(tiny.root), NAME, *SEED, "--data-dir",
         str(tiny.data), "--log-dir", str(log_dir), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# name -> (signal, the epoch it lands in, harness options)
STOPS = {"SIGKILL": (signal.SIGKILL, 3, ["--checkpoint-every", "1"]),
         "SIGTERM": (signal.SIGTERM, 2, ["--checkpoint-every", "3"]),
         "SIGINT": (signal.SIGINT, 2, [])}


@pytest.fixture(scope="module")
def stopped(never):
    """The STOPS runs, in subprocesses at once, each sent its signal three batches after
    the epoch_start of its epoch: name -> (exit code, stdout, stderr, set directory)."""
    procs = {name: _start(never, never.root / name, *args)
             for name, (_, _, args) in STOPS.items()}
    started, sent, deadline = {}, set(), time.monotonic() + 180
    while len(sent) < len(procs):
        assert time.monotonic() < deadline, "the runs did not reach their epochs"
        for name, proc in procs.items():
            sig, epoch, _ = STOPS[name]
            if name in sent:
                continue
            if name in started:
                if time.monotonic() - started[name] > 3 * STEP_SLEEP:
                    proc.send_signal(sig)
                    sent.add(name)
                continue
            assert proc.poll() is None, proc.communicate()
            logs = list((never.root / name).glob("*/result_0.txt"))
            if logs and epoch in _epoch_starts(logs[0]):
                started[name] = time.monotonic()
        time.sleep(0.02)
    outputs = {name: proc.communicate(timeout=120) for name, proc in procs.items()}
    return {name: (proc.returncode, *outputs[name], only_set(never.root / name))
            for name, proc in procs.items()}


def _epoch_starts(log):
    lines = Path(log).read_text().splitlines(keepends=True)
    events = [json.loads(line[len(":::MLLOG "):]) for line in lines if line.endswith("\n")]
    return [e["metadata"]["epoch_num"] for e in events if e["key"] == "epoch_start"]


def _resume(tiny, set_dir: Path) -> tuple[int, Path]:
    """Resumes the set; (exit code, the new set directory)."""
    code = tiny.main("--resume", str(set_dir))
    return code, newest_set(set_dir.parent)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_reproduces_the_evaluations(never, stopped, reference,
                                                                  capsys):
    code, _, _, killed = stopped["SIGKILL"]  # in epoch 3; epochs 1 and 2 checkpointed
    assert code == -signal.SIGKILL
    killed_log = (killed / "result_0.txt").read_text()
    assert _epoch_starts(killed / "result_0.txt") == [1, 2, 3] and "run_stop" not in killed_log
    steps = checkpoint.complete_steps(killed / "checkpoints" / "run_0")
    assert steps == [8, 16]  # after epochs 1 and 2 (8 steps an epoch)

    code, resumed = _resume(never, killed)
    out = capsys.readouterr().out
    assert code == 1  # the target 1.01 is never reached: a complete, unconverged run
    assert resumed != killed and "resumed from" in out and "resuming set" in out
    summary = read_summary(resumed)
    assert _evals(summary) == reference  # bit for bit: accuracies and train losses
    # The interrupted set is kept untouched.
    assert (killed / "result_0.txt").read_text() == killed_log
    assert not (killed / "summary.json").exists()

    # The log: the interrupted log's lines up to the checkpoint, run_resumed, the rest.
    log = resumed / "result_0.txt"
    events = read_events(log)
    keys = [e["key"] for e in events]
    assert keys.count("init_start") == 1 and keys.count("run_start") == 1
    assert keys.count("run_resumed") == 1 and keys[-1] == "run_stop"
    assert _epoch_starts(log) == [1, 2, 3, 4]
    resumed_event = events[keys.index("run_resumed")]
    assert resumed_event["metadata"]["epoch_num"] == 3
    assert resumed_event["metadata"]["steps_done"] == 0
    assert "not a valid closed-division timing" in resumed_event["metadata"]["note"]
    assert keys.index("run_resumed") > max(i for i, k in enumerate(keys) if k == "eval_accuracy"
                                           and events[i]["metadata"]["epoch_num"] == 2)
    assert killed_log.splitlines()[:keys.index("run_resumed")] == \
        log.read_text().splitlines()[:keys.index("run_resumed")]
    assert summary["runs"][0]["compliance"], (resumed / "compliance_0.log").read_text()

    # The summary marks it, and it is not an official result.
    assert summary["resumed"]["runs"] == [0] and summary["resumed"]["from_set"] == str(killed)
    assert summary["runs"][0]["resumed"][0]["epoch_num"] == 3 and not summary["official"]
    assert "success" not in summary["runs"][0]["status"]
    assert "resumed from a checkpoint" in out and "aborted*" in out
    assert json.loads((resumed / "config.json").read_text())["resumed_from"] == str(killed)


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_cleanly(never, stopped, reference, sig, code):
    """SIGTERM with checkpointing (a final checkpoint mid-epoch, resumed bit for bit),
    SIGINT without (nothing saved). Both: one line, the exit code, run_stop aborted."""
    returncode, out, err, set_dir = stopped[sig.name]
    assert returncode == code, err
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"interrupted by {sig.name}: run 0 stopped "
                                                   f"in epoch 2 after step"), err
    events = read_events(set_dir / "result_0.txt")
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["status"] == "aborted"
    assert events[-1]["metadata"]["interrupted_by"] == sig.name
    assert not (set_dir / "summary.json").exists()
    if sig == signal.SIGINT:
        assert "no checkpoint (checkpointing is off" in lines[0]
        assert not (set_dir / "checkpoints").exists()
        return
    assert "final checkpoint" in lines[0] and f"--resume {set_dir}" in lines[0]
    (found,) = [checkpoint.latest(set_dir, 0)]
    position = found.loop["position"]
    assert position["next_epoch"] == 2 and 0 < position["steps_done"] < 8
    assert found.loop["reason"] == "SIGTERM" and found.step == 8 + position["steps_done"]
    assert found.loop["data_order"]["seed"] == 7 and found.loop["config"]["seed"] == 7

    code, resumed = _resume(never, set_dir)
    summary = read_summary(resumed)
    assert _evals(summary) == reference  # resumed mid-epoch, still bit for bit
    assert _epoch_starts(resumed / "result_0.txt") == [1, 2, 3, 4]
    assert summary["runs"][0]["compliance"], (resumed / "compliance_0.log").read_text()


def test_an_unfinished_checkpoint_is_never_loaded(never, reference, tmp_path, capsys):
    """Two runs of 3 epochs with checkpoints; then run 0's are damaged as interrupted saves
    would leave them, and both runs are made unfinished: run 0 starts over, run 1
    continues from its checkpoint after epoch 2."""
    log_dir = tmp_path / "logs"
    assert never.main(NAME, *SEED, "--runs", "2", "--data-dir", str(never.data), "--log-dir",
                      str(log_dir), "--checkpoint-every", "1", "--max-epochs", "3") == 1
    set_dir = only_set(log_dir)
    first = read_summary(set_dir)
    run_dir = set_dir / "checkpoints" / "run_0"
    assert checkpoint.complete_steps(run_dir) == [8, 16]
    # As if the save after epoch 2 was cut short: no commit marker, and a step still in
    # orbax's temporary directory.
    (run_dir / "16" / checkpoint.COMMIT_MARKER).unlink()
    shutil.copytree(run_dir / "8", run_dir / "24.orbax-checkpoint-tmp-1234")
    assert checkpoint.complete_steps(run_dir) == [8]
    assert checkpoint.latest(set_dir, 0).step == 8
    (run_dir / "8" / "state" / checkpoint.COMMIT_MARKER).unlink()  # a half-written item
    assert checkpoint.complete_steps(run_dir) == [] and checkpoint.latest(set_dir, 0) is None

    # A finished-run record is what a resume carries over: removed, as if the runs had
    # been interrupted after their last checkpoints.
    for i in (0, 1):
        (set_dir / "checkpoints" / f"run_{i}.json").unlink()
    code = never.main("--resume", str(set_dir))
    assert code == 1
    new = newest_set(log_dir)
    assert new != set_dir
    keys = [e["key"] for e in read_events(new / "result_0.txt")]
    assert "run_resumed" not in keys and keys[0] == "init_start"  # started over
    assert "run_resumed" in [e["key"] for e in read_events(new / "result_1.txt")]
    summary = read_summary(new)
    assert summary["resumed"]["runs"] == [1] and summary["runs"][0]["resumed"] is None
    assert summary["runs"][1]["resumed"][0]["checkpoint"] == str(
        set_dir / "checkpoints" / "run_1" / "16")
    assert _evals(summary)[:3] == reference[:3]

    def curves(s):
        return [[(e["epoch"], e["accuracy"], e["loss"]) for e in r["evals"]] for r in s["runs"]]
    assert curves(summary) == curves(first)  # both runs, started over or resumed


def test_resume_errors(never, tmp_path, capsys):
    log_dir = tmp_path / "logs"
    assert never.main(NAME, *SEED, "--data-dir", str(never.data), "--log-dir", str(log_dir),
                      "--max-epochs", "1") == 1
    set_dir = only_set(log_dir)
    capsys.readouterr()
    assert never.main("--resume", str(set_dir)) == 2
    assert "without --checkpoint-every" in capsys.readouterr().err
    assert never.main("--resume", str(tmp_path / "nope")) == 2
    assert "no such directory" in capsys.readouterr().err
    assert never.main() == 2
    assert never.main(NAME, "--processes", "2", "--checkpoint-every", "1") == 2
    assert "single-process only" in capsys.readouterr().err
    # A set with checkpoints, resumed with an option of its own: refused.
    assert never.main(NAME, *SEED, "--data-dir", str(never.data), "--log-dir", str(log_dir),
                      "--max-epochs", "1", "--checkpoint-every", "1") == 1
    capsys.readouterr()
    assert never.main("--resume", str(log_dir), "--impl", "xla") == 2
    assert "--resume takes --impl" in capsys.readouterr().err
    # Everything finished: resuming carries the run over, marks nothing as resumed.
    assert never.main("--resume", str(log_dir)) == 1
    new = newest_set(log_dir)
    assert read_summary(new)["resumed"] is None and (new / "result_0.txt").is_file()
