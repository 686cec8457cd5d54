"""The configuration of a set of runs (``SetConfig``) and its checks before anything runs.

``check(config)`` finds everything that can be wrong with the options, the
hyperparameters and the data (UsageError, hparams.HparamError, data.DataError) and
returns what the runs use: the resolved hyperparameters, the epoch limit, every run's
seed and the data files.
"""

import dataclasses
import secrets
from typing import Any, Callable, Mapping, Optional

from jax_brgemm import precision as jb_precision
from jax_brgemm.models import IMPLS

from . import checkpoint, data, distributed
from .hparams import resolve
from .suite import SUITE, Benchmark, Suite

DTYPES = ("float32", "bfloat16")
PRECISIONS = tuple(jb_precision.HARNESS)
MAX_SEED = 2**32 - 1
SYSTEM_SEED_SOURCE = "system randomness (secrets.randbits(31), /dev/urandom)"


class UsageError(Exception):
    """A bad option value or an unusable setup (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class SetConfig:
    """One invocation's set of runs: what ``run_benchmark`` and the command line take.

    Attributes:
      bench: the benchmark to run.
      impl, division, dtype, precision: ``--impl``, ``--division``, ``--dtype``,
        ``--precision``.
      runs: the number of runs; ``seed``: the first run's seed (open division only;
        None: system randomness).
      data_dir, log_dir: ``--data-dir`` and ``--log-dir`` (None: the defaults).
      overrides: hyperparameters replacing the reference ones; ``hparams_file``: the
        file they were read from, recorded in config.json.
      max_epochs: the epoch limit (None: the benchmark's).
      show_progress: print the progress of every run.
      check_replicas: debug: the parameters identical on every process, each epoch.
      checkpoint_every: checkpoint every E epochs (0: never).
      resume: the interrupted set to continue (its seeds, finished runs, checkpoints).
      suite: the suite holding ``bench``, whose rules check the logs.
      on_run_end: called on every process with each run's final TrainState (for tests
        and tools).
    """

    bench: Benchmark
    impl: str = "brgemm"
    division: str = "closed"
    runs: int = 1
    seed: Optional[int] = None
    dtype: str = "float32"
    precision: str = "float32"
    data_dir: Any = None
    log_dir: Any = None
    overrides: Optional[Mapping[str, Any]] = None
    hparams_file: Optional[str] = None
    max_epochs: Optional[int] = None
    show_progress: bool = True
    check_replicas: bool = False
    checkpoint_every: int = 0
    resume: Optional[checkpoint.SetResume] = None
    suite: Suite = dataclasses.field(default_factory=lambda: SUITE)
    on_run_end: Optional[Callable[[Any], None]] = None


@dataclasses.dataclass(frozen=True)
class Checked:
    """A SetConfig that passed its checks, and what its runs use."""

    config: SetConfig
    hparams: dict
    max_epochs: int
    seeds: list           # (seed, where it came from) of each run
    paths: dict           # the dataset's files: role -> path

    def run_config(self):
        """The configuration every run of the set shares (loop.RunConfig)."""
        from . import loop

        c = self.config
        return loop.RunConfig(bench=c.bench, impl=c.impl, division=c.division, dtype=c.dtype,
                              precision=c.precision,
                              hparams=self.hparams, max_epochs=self.max_epochs,
                              config_filename="config.json", target=c.bench.target,
                              check_replicas=c.check_replicas, on_run_end=c.on_run_end)


def seeds(seed: Optional[int], runs: int, division: str) -> list[tuple[int, str]]:
    """(seed, where it came from) of each run.

    Closed division: system randomness only (MLPerf allows the clock, the system's
    randomness or a generator seeded from those); a fixed seed is refused. Open
    division: ``seed`` + run index when given, for reproducing a run.
    """
    if seed is None:
        return [(secrets.randbits(31), SYSTEM_SEED_SOURCE) for _ in range(runs)]
    if division == "closed":
        raise UsageError("[rule closed/seed] --seed is not allowed in the closed division: "
                         "its seeds must come from system randomness (MLPerf rules on random "
                         "number generators). To reproduce a run, pass --division open "
                         "--seed S (same computation, logged as open)")
    if not 0 <= seed <= MAX_SEED - (runs - 1):
        raise UsageError(f"--seed must be in [0, {MAX_SEED - (runs - 1)}] (run i uses seed + i, "
                         f"a 32-bit unsigned value), got {seed}")
    return [(seed + i, f"--seed {seed} + run index {i}") for i in range(runs)]


def check(config: SetConfig) -> Checked:
    """Checks the options, the hyperparameters and the data before anything is trained or
    written. In a job of several processes, every process gets process 0's seeds."""
    c = config
    if c.runs < 1:
        raise UsageError(f"--runs must be at least 1, got {c.runs}")
    if c.dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {DTYPES}, got {c.dtype!r}")
    if c.precision not in PRECISIONS:
        raise UsageError(f"--precision must be one of {PRECISIONS}, got {c.precision!r}")
    if c.precision != "float32" and c.impl != "brgemm":
        raise UsageError(f"--precision {c.precision} applies to --impl brgemm only: stock XLA "
                         f"on CPU ignores the precision of its products and computes float32")
    max_epochs = c.bench.max_epochs if c.max_epochs is None else c.max_epochs
    if max_epochs < 1:
        raise UsageError(f"--max-epochs must be at least 1, got {max_epochs}")
    if c.log_dir is not None and str(c.log_dir).strip() == "":
        raise UsageError("--log-dir must not be empty (leave it out for runs/BENCHMARK/IMPL)")
    if c.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be at least 1 (epochs), got "
                         f"{c.checkpoint_every}")
    # A resumed set keeps the seeds it drew (and logged) at its start.
    run_seeds = c.resume.seeds if c.resume else seeds(c.seed, c.runs, c.division)
    hp = resolve(c.bench, dict(c.overrides or {}), c.division)
    if c.impl not in IMPLS:
        raise UsageError(f"--impl must be one of {IMPLS}, got {c.impl!r}")
    paths = data.locate(c.bench.dataset, c.data_dir)
    for path in paths.values():
        filesystem = data.in_memory_filesystem(path)
        if filesystem:
            raise UsageError(f"{path} is on {filesystem}, in RAM; MLPerf requires the data to "
                             f"start on durable storage, which excludes RAM. Fix: copy the "
                             f"files to a directory on disk and pass --data-dir DIR")
    if distributed.job() is not None:
        import jax

        if hp["global_batch_size"] % jax.device_count():
            raise UsageError(f"global_batch_size {hp['global_batch_size']} is not divisible by "
                             f"the {jax.device_count()} devices of the job: each takes an "
                             f"equal shard of every batch")
        # every process uses process 0's seeds (drawn from its system randomness)
        run_seeds = list(zip(distributed.broadcast_from_0([s for s, _ in run_seeds]),
                             [source for _, source in run_seeds], strict=True))
    return Checked(config, hp, max_epochs, run_seeds, paths)
