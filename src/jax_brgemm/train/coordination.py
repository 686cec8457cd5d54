"""Joining a job of processes (``jax.distributed`` with CPU collectives over gloo) and
waiting on the other processes with a bound.

Every blocking wait on a collective runs under a :class:`Watchdog` that ends the
process (exit code ``EXIT_WORKER_FAILED``) when it waits longer than
``--collective-timeout``; the coordinator's heartbeats catch a process that stopped
answering.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Optional, Sequence

import numpy as np

from .launcher import EXIT_WORKER_FAILED

DEFAULT_COLLECTIVE_TIMEOUT = 300.0


class DistributedError(Exception):
    """The processes of a job disagree (e.g. different parameters) or cannot start."""


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
