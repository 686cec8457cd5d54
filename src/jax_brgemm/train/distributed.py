"""Scale-out: data-parallel runs over processes and hosts on ``jax.distributed``.

Two ways in, one code path:

* ``--processes N`` (one machine): launcher.py starts N workers, each the same command
  with ``--coordinator 127.0.0.1:PORT --num-processes N --process-id I``.
* ``--coordinator HOST:PORT --num-processes N --process-id I`` (several hosts, or the
  workers above): coordination.py joins the job (``jax.distributed.initialize`` with CPU
  collectives over gloo) and bounds every wait on the other processes.

In the run, topology.py's :class:`Topology` is the mesh over every process's devices.
This module gathers the three under one name, the one the harness and the benchmarks use.

A dead or hung worker ends the job within a bounded time, never a silent hang: the
launcher sees a worker exit and stops the others; on any host a wait on a collective
that lasts longer than ``--collective-timeout`` ends the process; the coordinator's
heartbeats catch a process that stopped answering.
"""

from .coordination import (DEFAULT_COLLECTIVE_TIMEOUT, DistributedError, JobSpec, Watchdog,
                           barrier, broadcast_from_0, initialize, is_logger, job, process_index,
                           waiting)
from .launcher import EXIT_WORKER_FAILED, core_shares, entry_command, free_port, launch
from .topology import AXIS, Topology, topology

__all__ = ["AXIS", "DEFAULT_COLLECTIVE_TIMEOUT", "EXIT_WORKER_FAILED", "DistributedError",
           "JobSpec", "Topology", "Watchdog", "barrier", "broadcast_from_0", "core_shares",
           "entry_command", "free_port", "initialize", "is_logger", "job", "launch",
           "process_index", "topology", "waiting"]
