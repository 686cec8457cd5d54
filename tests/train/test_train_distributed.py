"""Scale-out: a 2-process run (python -m jax_brgemm.train ... --processes 2) equals a
1-process run with the same global batch; a killed worker ends the job non-zero with a
clear message within a bounded time. Tiny generated data, the multi-process runs started
by tests/train/harness_driver.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_benchmark import only_set, params_saver, saved_params

from jax_brgemm.train import cli, data, distributed

DRIVER = str(Path(__file__).parent / "harness_driver.py")


def _cli(tiny, *args, env=None, **kw):
    cmd = [sys.executable, DRIVER, str(tiny.root), *args, "--data-dir", str(tiny.data)]
    return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
def test_two_processes_equal_one_process(tiny, capsys):
    args = ["tiny", "--impl", "brgemm", "--division", "open", "--seed", "3", "--max-epochs",
            "2", "--check-replicas"]
    runs = {}
    for n in (2, 1):
        prefix = str(tiny.root / f"params{n}")
        log_dir = str(tiny.root / f"log{n}")
        if n == 2:  # the job: its own processes
            proc = _cli(tiny, *args, "--log-dir", log_dir, "--processes", "2",
                        env={"JB_TEST_PARAMS": prefix})
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, out + err
        else:  # one process: here (saves a start-up)
            assert tiny.main(*args, "--data-dir", str(tiny.data), "--log-dir", log_dir,
                             on_run_end=params_saver(prefix)) == 0
            out = capsys.readouterr().out
        runs[n] = (json.loads((only_set(log_dir) / "summary.json").read_text()), prefix, out)
    (one, p1, _), (two, p2, out2) = runs[1], runs[2]
    # parameters after the same 16 steps: equal within fp tolerance (another summation
    # order: the gradients of two halves of each batch are all-reduced)
    for a, b in zip(saved_params(p1, 0), saved_params(p2, 0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # identical on both processes (also checked each epoch by --check-replicas)
    for a, b in zip(saved_params(p2, 0), saved_params(p2, 1), strict=True):
        np.testing.assert_array_equal(a, b)
    e1, e2 = one["runs"][0]["evals"], two["runs"][0]["evals"]
    assert [e["epoch"] for e in e1] == [e["epoch"] for e in e2]
    for a, b in zip(e1, e2, strict=True):
        assert abs(a["accuracy"] - b["accuracy"]) <= 1 / 300  # at most one test example
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"]))
    # only process 0 logged: one progress display, one log passing the checker
    assert out2.count("run 1/1") == 1 and "PASSED" in out2
    assert sorted(p.name for p in only_set(tiny.root / "log2").iterdir()) == [
        "accuracy.png", "compliance_0.log", "config.json", "result_0.txt", "summary.json"]
    log = (only_set(tiny.root / "log2") / "result_0.txt").read_text()
    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in log.splitlines()]
    value = {e["key"]: e["value"] for e in events}
    assert value["number_of_nodes"] == 1 and value["accelerators_per_node"] == 2
    assert value["global_batch_size"] == 64 and value["micro_batch_size"] == 32
    assert value["lowest_numerical_precision_in_comm"] == "fp32"


def _children(pid):
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _worker(pid, index):
    for child in _children(pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"--process-id" in cmdline and cmdline[cmdline.index(b"--process-id") + 1] == \
                str(index).encode():
            return child
    return None


def _wait_for_training(log_dir, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = list(log_dir.glob("*/result_0.txt"))
        if logs and '"epoch_start"' in logs[0].read_text():
            return
        time.sleep(0.2)
    raise AssertionError("the job did not start training")


def _stop_a_worker(tiny, name, sig, *args, timeout):
    """A 2-process job of tiny_never (run until stopped) whose worker 1 gets ``sig`` once
    it trains: (the launcher, its stderr, seconds from the signal to the job's end)."""
    log_dir = tiny.root / name
    proc = _cli(tiny, "tiny_never", "--impl", "xla", "--max-epochs", "200", "--log-dir",
                str(log_dir), "--processes", "2", *args)
    try:
        _wait_for_training(log_dir)
        worker = _worker(proc.pid, 1)
        assert worker is not None
        os.kill(worker, sig)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=timeout)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    return proc, err, elapsed


@pytest.mark.slow
def test_killed_worker_ends_the_job_with_a_clear_message(tiny):
    proc, err, elapsed = _stop_a_worker(tiny, "killed", signal.SIGKILL, timeout=60)
    assert proc.returncode == distributed.EXIT_WORKER_FAILED
    assert "worker 1 of 2" in err and "killed by signal SIGKILL" in err, err[-2000:]
    assert elapsed < 30
    assert _children(proc.pid) == []


def test_watchdog_ends_a_process_that_waits_too_long():
    code = ("import time; from jax_brgemm.train import distributed as d\n"
            "dog = d.Watchdog(0.5)\n"
            "with dog.waiting('a quick step'):\n    time.sleep(0.1)\n"
            "with dog.waiting('a train step'):\n    time.sleep(30)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == distributed.EXIT_WORKER_FAILED
    assert "for a train step (--collective-timeout)" in proc.stderr
    assert "another worker died or hung" in proc.stderr
    assert time.monotonic() - t0 < 20


@pytest.mark.slow  # a 2-process job waiting out the collective timeout, ~40 s
def test_hung_worker_ends_the_job_after_the_collective_timeout(tiny):
    # SIGSTOP: alive, but never answers again
    proc, err, elapsed = _stop_a_worker(tiny, "hung", signal.SIGSTOP, "--collective-timeout",
                                        "5", timeout=90)
    assert proc.returncode == distributed.EXIT_WORKER_FAILED
    assert "waited 5 s" in err and "another worker died or hung" in err, err[-2000:]
    assert elapsed < 45


def test_shards_of_a_global_batch_are_its_rows():
    inputs, labels = np.arange(10 * 3).reshape(10, 3), np.arange(10)
    whole = list(data.train_batches(inputs, labels, 4, seed=5, epoch=2))
    halves = [list(data.train_batches(inputs, labels, 4, seed=5, epoch=2, shard=(i, 2)))
              for i in range(2)]
    for b, h0, h1 in zip(whole, *halves, strict=True):
        for field in range(3):
            np.testing.assert_array_equal(b[field], np.concatenate([h0[field], h1[field]]))
    ev = [list(data.eval_batches(inputs, labels, 4, shard=(i, 2))) for i in range(2)]
    assert sum(float(b.weight.sum()) for part in ev for b in part) == 10
    with pytest.raises(ValueError, match="dividing the batch size"):
        next(data.train_batches(inputs, labels, 5, 0, 1, shard=(0, 2)))


def test_core_shares_and_worker_arguments():
    assert distributed.core_shares([0, 1], 2) == [[0], [1]]
    assert distributed.core_shares([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3, 4]]
    assert distributed.core_shares([0], 2) == [[0], [0]]
    assert cli._without_processes(["mlp", "--processes", "2", "--seed", "1"]) == [
        "mlp", "--seed", "1"]
    assert cli._without_processes(["mlp", "--processes=2"]) == ["mlp"]
    assert cli.main(["mlp", "--coordinator", "127.0.0.1:1"]) == cli.EXIT_ERROR
