"""Scale-out: data-parallel runs over processes and hosts on ``jax.distributed``.

Two ways in, one code path:

* ``--processes N`` (one machine): :func:`launch` starts N workers, each the same command
  with ``--coordinator 127.0.0.1:PORT --num-processes N --process-id I`` (a free port),
  gives each its own share of the cores (CPU affinity, which also sizes XLA's intra-op
  pool), forwards SIGINT/SIGTERM, watches them and returns the job's exit code.
* ``--coordinator HOST:PORT --num-processes N --process-id I`` (several hosts, or the
  workers above): :func:`initialize` joins the job (``jax.distributed.initialize`` with
  CPU collectives over gloo).

A dead or hung worker ends the job within a bounded time, never a silent hang: the
launcher sees a worker exit and stops the others; on any host, every blocking wait on a
collective runs under a :class:`Watchdog` that ends the process (exit code
``EXIT_WORKER_FAILED``) when it waits longer than ``--collective-timeout``; and the
coordinator's heartbeats catch a process that stopped answering.

In the run (loop.py), a :class:`Topology` is the mesh over every process's devices: the
train and eval steps run under ``shard_map`` with the step's ``axis_name``, each device
on its shard of the global batch (data.train_batches(shard=...) builds only this
process's rows), and the parameters are replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

import numpy as np

AXIS = "batch"
EXIT_WORKER_FAILED = 3
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


class DistributedError(Exception):
    """The processes of a job disagree (e.g. different parameters) or cannot start."""


# --------------------------------------------------------------------------- launcher


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


# --------------------------------------------------------------------------- joining a job


@dataclasses.dataclass(frozen=True)
class JobSpec:
    coordinator: str
    num_processes: int
    process_id: int
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT


_JOB: Optional[JobSpec] = None
_WATCHDOG: Optional["Watchdog"] = None


def initialize(job: JobSpec) -> None:
    """Joins the job: CPU collectives over gloo, then ``jax.distributed.initialize``.

    Must run before anything creates a JAX backend. A worker started by :func:`launch`
    already has its cores (affinity); XLA sizes its intra-op pool from them.
    """
    global _JOB, _WATCHDOG
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = max(10, int(job.collective_timeout))
    try:
        jax.distributed.initialize(job.coordinator, job.num_processes, job.process_id,
                                   initialization_timeout=timeout,
                                   heartbeat_timeout_seconds=timeout)
    except Exception as e:  # e.g. the coordinator is unreachable: XLA's own error type
        raise DistributedError(f"cannot join the job at {job.coordinator} as process "
                               f"{job.process_id} of {job.num_processes}: {e}") from e
    _JOB = job
    _WATCHDOG = Watchdog(job.collective_timeout)


def job() -> Optional[JobSpec]:
    return _JOB


def process_index() -> int:
    return 0 if _JOB is None else _JOB.process_id


def is_logger() -> bool:
    """Only process 0 writes the MLPerf log, the summary and the progress display."""
    return process_index() == 0


class Watchdog:
    """Ends the process when one blocking wait on the other processes takes too long.

    ``with watchdog.waiting("train step"):`` around a wait (a result fetched from a
    collective step, a barrier): a background thread ends the process with
    ``EXIT_WORKER_FAILED`` and a message naming the wait, ``timeout`` s after it began.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._what, self._since = None, 0.0
        threading.Thread(target=self._run, name="jax_brgemm-watchdog", daemon=True).start()

    def waiting(self, what: str):
        return _Waiting(self, what)

    def _run(self):
        while True:
            time.sleep(min(1.0, self.timeout / 10))
            with self._lock:
                what, since = self._what, self._since
            if what is not None and time.monotonic() - since > self.timeout:
                print(f"error: process {process_index()} waited {self.timeout:g} s for "
                      f"{what} (--collective-timeout): another worker died or hung; "
                      f"ending this process", file=sys.stderr, flush=True)
                os._exit(EXIT_WORKER_FAILED)


class _Waiting:
    def __init__(self, dog, what):
        self.dog, self.what = dog, what

    def __enter__(self):
        with self.dog._lock:
            self.dog._what, self.dog._since = self.what, time.monotonic()

    def __exit__(self, *exc):
        with self.dog._lock:
            self.dog._what = None


class _NoWait:
    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


def waiting(what: str):
    """A watchdog guard around a wait on the other processes (a no-op in one process)."""
    return _WATCHDOG.waiting(what) if _WATCHDOG is not None else _NoWait()


def broadcast_from_0(values: Sequence[int]) -> list[int]:
    """Process 0's integers (e.g. the seeds drawn from system randomness) on every process."""
    if _JOB is None:
        return list(values)
    from jax.experimental import multihost_utils

    with waiting("the seeds from process 0"):
        out = multihost_utils.broadcast_one_to_all(np.asarray(values, np.int64))
    return [int(v) for v in np.asarray(out)]


def barrier(name: str) -> None:
    if _JOB is None:
        return
    from jax.experimental import multihost_utils

    with waiting(f"barrier {name!r}"):
        multihost_utils.sync_global_devices(name)


# --------------------------------------------------------------------------- the mesh


def _host_id() -> int:
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:4], "little")


@dataclasses.dataclass
class Topology:
    """The job's devices as a 1-D data-parallel mesh (axis ``AXIS``), and this process's
    place in it: its shard of every global batch is rows ``[index * rows, (index+1) * rows)``
    with ``rows = global_batch // num_processes``."""

    mesh: object
    num_processes: int
    process_index: int
    num_hosts: int

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def devices_per_host(self) -> int:
        return self.num_devices // self.num_hosts

    @property
    def shard(self) -> tuple[int, int]:
        """(this process's index, number of processes): what data.train_batches takes."""
        return self.process_index, self.num_processes

    def check_batch(self, what: str, size: int) -> None:
        if size % self.num_devices:
            raise ValueError(f"{what} {size} is not divisible by the job's {self.num_devices} "
                             f"devices ({self.num_processes} processes): every device takes "
                             f"an equal shard")

    # --- arrays
    def _sharding(self, spec):
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def replicate(self, tree):
        """The same values on every device (every process passes the same ``tree``)."""
        import jax

        rep = self._sharding(())
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(rep, np.asarray(x)), tree)

    def global_batch(self, local_batch):
        """This process's rows of a global batch -> the global batch, sharded by rows."""
        import jax

        rows = self._sharding((AXIS,))
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
            rows, x, (x.shape[0] * self.num_processes,) + x.shape[1:]), local_batch)

    def batch_spec(self, batch):
        """ShapeDtypeStructs of a global batch like ``batch``, sharded by rows."""
        import jax

        rows = self._sharding((AXIS,))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows),
                            batch)

    @staticmethod
    def local(x) -> np.ndarray:
        """This process's copy of a replicated array."""
        return np.asarray(x.addressable_data(0))

    # --- steps
    def data_parallel(self, fn, out_specs):
        """``fn(state, batch, axis_name=AXIS)`` under shard_map: state replicated, the batch
        split by rows over the mesh."""
        import jax
        from jax.sharding import PartitionSpec as P

        body = functools.partial(fn, axis_name=AXIS)
        # check_vma=False: the step averages with pmean itself (pmap semantics). With
        # check_vma, the gradient of the replicated parameters would already be summed
        # over the axis (the transpose of their implicit broadcast) before the pmean.
        return jax.shard_map(body, mesh=self.mesh, in_specs=(P(), P(AXIS)),
                             out_specs=out_specs, check_vma=False)

    def check_replicas(self, tree, what: str = "parameters") -> None:
        """Raises DistributedError unless every process holds bit-identical ``tree``."""
        import jax
        from jax.experimental import multihost_utils

        digest = hashlib.sha256()
        for leaf in jax.tree.leaves(tree):
            digest.update(np.ascontiguousarray(self.local(leaf)).tobytes())
        mine = np.frombuffer(digest.digest()[:8], np.int32)
        with waiting(f"the {what} of every process"):
            every = np.asarray(multihost_utils.process_allgather(mine))
        differ = [p for p in range(len(every)) if not np.array_equal(every[p], every[0])]
        if differ:
            raise DistributedError(f"the {what} differ between processes: process 0 and "
                                   f"processes {differ} hold different values")


def topology() -> Optional[Topology]:
    """The data-parallel mesh over every device of the job; None for one device."""
    import jax
    from jax.sharding import Mesh

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) == 1:
        return None
    num_hosts = 1
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        with waiting("the host names of every process"):
            hosts = np.asarray(multihost_utils.process_allgather(
                np.array([_host_id()], np.int64)))
        num_hosts = len(set(hosts.ravel().tolist()))
    return Topology(Mesh(np.array(devices), (AXIS,)), jax.process_count(),
                    jax.process_index(), num_hosts)
