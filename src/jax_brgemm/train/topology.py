"""The job's devices as a data-parallel mesh, and this process's place in it.

In a run (loop.py) the train and eval steps run under ``shard_map`` with the step's
``axis_name``, each device on its shard of the global batch (data.train_batches(shard=...)
builds only this process's rows), and the parameters are replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import socket
from typing import Optional

import numpy as np

from .coordination import DistributedError, waiting

AXIS = "batch"


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
