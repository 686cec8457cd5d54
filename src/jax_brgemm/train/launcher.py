"""Process launch: ``--processes N`` runs N workers of one job on this machine.

:func:`launch` starts N workers, each the same command with ``--coordinator
127.0.0.1:PORT --num-processes N --process-id I`` (a free port), gives each its own share
of the cores (CPU affinity, which also sizes XLA's intra-op pool), forwards SIGINT and
SIGTERM, watches them and returns the job's exit code: a worker that dies ends the job,
never a silent hang.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

EXIT_WORKER_FAILED = 3


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_shares(cores: Sequence[int], n: int) -> list[list[int]]:
    """Splits the cores into n contiguous shares as even as possible; with fewer cores
    than processes, processes share cores round-robin (oversubscribed, still correct)."""
    cores = sorted(cores)
    if n <= len(cores):
        bounds = [round(i * len(cores) / n) for i in range(n + 1)]
        return [cores[bounds[i]:bounds[i + 1]] for i in range(n)]
    return [[cores[i % len(cores)]] for i in range(n)]


def entry_command() -> list[str]:
    """How this process was started, without its arguments: ``[python, -m, pkg]`` or
    ``[python, script.py]``, so workers run the same entry point (and whatever it set up)."""
    orig = list(getattr(sys, "orig_argv", []))
    if orig and len(orig) >= len(sys.argv):
        return orig[:len(orig) - (len(sys.argv) - 1)]
    return [sys.executable, "-m", "jax_brgemm.train"]


def _worker_setup(cores):
    def setup():
        os.sched_setaffinity(0, cores)
        try:  # the worker dies with the launcher, even when the launcher is SIGKILLed
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    return setup


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(args: Sequence[str], processes: int, *, command: Optional[Sequence[str]] = None,
           cores: Optional[Sequence[int]] = None, grace: float = 10.0,
           finish_timeout: float = 120.0, err=None) -> int:
    """Runs ``command + args`` as ``processes`` workers of one job on this machine.

    Returns process 0's exit code when every worker ends normally (0 or 1: the run's
    result); when a worker fails (a non-zero exit other than process 0's own 1, or a
    signal), prints which and why, stops the others (SIGTERM, then SIGKILL after
    ``grace`` s) and returns that worker's code (or ``EXIT_WORKER_FAILED`` for a signal).
    Workers still running ``finish_timeout`` s after process 0 finished are stopped too.
    ``cores``: the cores to share out (default: this process's CPU affinity).
    """
    err = err or sys.stderr
    command = list(command or entry_command())
    port = free_port()
    shares = core_shares(sorted(cores or os.sched_getaffinity(0)), processes)
    env = dict(os.environ)
    procs = []
    for i, cores in enumerate(shares):
        cmd = command + list(args) + ["--coordinator", f"127.0.0.1:{port}",
                                      "--num-processes", str(processes), "--process-id", str(i)]
        worker_env = {**env, "JAX_BRGEMM_WORKER_CORES": ",".join(map(str, cores))}
        # Own session: a Ctrl-C reaches the launcher only, which forwards it once.
        procs.append(subprocess.Popen(cmd, env=worker_env, preexec_fn=_worker_setup(cores),
                                      start_new_session=True))

    received = []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(procs, grace, finish_timeout, received, err)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop(procs, grace)


def _stop(procs, grace):
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _watch(procs, grace, finish_timeout, received, err) -> int:
    finished_at = None
    while True:
        codes = [p.poll() for p in procs]
        if received:
            # Forwarded: wait for the workers to stop, then report the signal.
            deadline = time.monotonic() + grace
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
            print(f"error: job stopped by {signal.Signals(received[0]).name}", file=err)
            return 128 + received[0]
        for i, code in enumerate(codes):
            # Process 0 exiting 1 (a run did not converge) is a result, not a failure;
            # any other worker ending non-zero, or by a signal, is.
            if code is not None and code != 0 and not (i == 0 and code == 1):
                print(f"error: worker {i} of {len(procs)} (pid {procs[i].pid}) "
                      f"{_exit_reason(code)}; stopping the other workers", file=err,
                      flush=True)
                return code if code > 0 else EXIT_WORKER_FAILED
        if all(c is not None for c in codes):
            return codes[0]
        if codes[0] is not None:
            finished_at = finished_at or time.monotonic()
            if time.monotonic() - finished_at > finish_timeout:
                late = [i for i, c in enumerate(codes) if c is None]
                print(f"error: process 0 finished but workers {late} still run after "
                      f"{finish_timeout:.0f} s; stopping them", file=err, flush=True)
                return EXIT_WORKER_FAILED
        time.sleep(0.05)
