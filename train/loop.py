"""One timed run, with MLPerf semantics and an MLPerf log.

    init (untimed): log the configuration, build the model, compile the train and
        eval steps on synthetic batches of the real shapes
    cache_clear:    evict the dataset files from the page cache
    run (timed):    run_start, read the dataset, train and evaluate epoch by epoch
                    (epochs numbered from 1), run_stop when the target is reached
                    ("success") or the epoch limit is ("aborted")
"""

import dataclasses
import functools
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from mlperf_logging.mllog.mllog import MLLogger
from mlperf_logging.mllog import constants as C

from . import data, distributed, optim, step

DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}
PRECISION = {"float32": "fp32", "bfloat16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs besides its seed.

    ``target=None`` trains all ``max_epochs`` (used to record reference curves).
    """

    bench: Any
    impl: str
    division: str
    dtype: str
    hparams: Mapping[str, Any]
    max_epochs: int
    config_filename: str = "suite defaults"
    target: Optional[float] = None
    check_replicas: bool = False  # debug: parameters identical on every process, each epoch


@dataclasses.dataclass
class RunResult:
    index: int
    seed: int
    status: str                 # "success" | "aborted"
    epochs: int                 # epochs trained
    time_to_train: float        # seconds from run_start to run_stop
    evals: list                 # [{"epoch", "accuracy", "loss", "time"}], time since run_start
    throughput: float           # training examples per second (train loop only)
    data_fraction: float        # share of the train loop spent producing batches
    log_path: str
    compliance: Optional[bool] = None

    @property
    def converged(self) -> bool:
        return self.status == C.SUCCESS


# --------------------------------------------------------------------------- logging


def platform_name() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x{os.cpu_count()} CPUs"


def open_log(path: Path) -> tuple[MLLogger, logging.Handler]:
    """An MLLogger writing only to ``path``: nothing reaches the terminal or other logs."""
    logger = logging.getLogger(f"jax_brgemm.train.run.{path}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    root = str(Path(__file__).resolve().parent)
    return MLLogger(logger=logger, root_dir=root), handler


def log_config(mll, cfg: RunConfig, seed: int, topo=None):
    bench, hp = cfg.bench, cfg.hparams
    mll.event(C.SUBMISSION_BENCHMARK, bench.name)
    mll.event(C.SUBMISSION_DIVISION, cfg.division)
    mll.event(C.SUBMISSION_ORG, "jax_brgemm")
    mll.event(C.SUBMISSION_PLATFORM, platform_name())
    mll.event(C.SUBMISSION_STATUS, C.RESEARCH)
    mll.event("model_impl", cfg.impl)  # not an MLPerf key: brgemm kernels or stock XLA
    mll.event(C.SEED, seed)
    mll.event(C.TRAIN_SAMPLES, bench.train_size)
    mll.event(C.EVAL_SAMPLES, bench.eval_size)
    mll.event(C.GRADIENT_ACCUMULATION_STEPS, 1)
    # opt_name first: the ruleset checks the other keys against the chosen optimizer.
    mll.event(C.OPT_NAME, hp["opt_name"])
    for key in sorted(k for k in hp if k != "opt_name"):
        mll.event(key, hp[key])
    precision = PRECISION[cfg.dtype]
    mll.event(C.LOWEST_NUMERICAL_PRECISION_IN_LINEAR, precision)
    mll.event(C.LOWEST_NUMERICAL_PRECISION_IN_ATTN, precision)  # no attention layers
    mll.event(C.LOWEST_NUMERICAL_PRECISION_IN_COMM, "fp32")  # gradients all-reduced in fp32
    for key in (C.TENSOR_PARALLELISM, C.PIPELINE_PARALLELISM, C.CONTEXT_PARALLELISM,
                C.EXPERT_PARALLELISM):
        mll.event(key, 1)
    devices = topo.num_devices if topo else 1
    mll.event(C.MICRO_BATCH_SIZE, hp["global_batch_size"] // devices)  # per device
    # The scale of the system, as MLPerf's result summarizer reads it: hosts, and the
    # devices (one per process on CPU) on each.
    mll.event("number_of_nodes", topo.num_hosts if topo else 1)
    mll.event("accelerators_per_node", topo.devices_per_host if topo else 1)
    mll.event(C.CONFIG_FILENAME, cfg.config_filename)


# --------------------------------------------------------------------------- run

#: For tests and tools: called on every process with the final TrainState of each run.
on_run_end = None


def _now_ms() -> int:
    return int(time.time() * 1e3)


def run(cfg: RunConfig, index: int, seed: int, paths: Mapping[str, Path], log_path: Path,
        progress=None) -> RunResult:
    """Performs one run and writes its MLPerf log to ``log_path``."""
    mll, handler = open_log(log_path)
    try:
        return _run(cfg, index, seed, paths, log_path, progress, mll)
    finally:
        handler.close()
        logging.getLogger(f"jax_brgemm.train.run.{log_path}").removeHandler(handler)


def _run(cfg, index, seed, paths, log_path, progress, mll):
    bench, hp = cfg.bench, cfg.hparams
    pipeline, batch_size = bench.pipeline, hp["global_batch_size"]

    # ---- init: untimed. Nothing here reads the dataset, only its declared shapes.
    mll.start(C.INIT_START)
    topo = distributed.topology()  # None in one process on one device
    eval_batch_size = bench.eval_batch_size
    if topo:
        topo.check_batch("global_batch_size", batch_size)
        eval_batch_size = -(-eval_batch_size // topo.num_devices) * topo.num_devices
    shard = topo.shard if topo else (0, 1)
    log_config(mll, cfg, seed, topo)
    model = bench.model(impl=cfg.impl, dtype=DTYPES[cfg.dtype])
    steps = optim.steps_per_epoch(bench.train_size, batch_size)
    example = pipeline.preprocess(jnp.asarray(pipeline.synthetic_batch(bench.dataset, 1).inputs))
    state = step.create_state(bench, model, optim.make(hp, steps), jax.random.key(seed), example)
    # Compiled ahead of time: a batch of another shape would be an error, never a
    # silent recompilation inside the timed run.
    train_fn = functools.partial(step.train_step, bench=bench)
    eval_fn = functools.partial(step.eval_step, bench=bench)
    train_batch = pipeline.synthetic_batch(bench.dataset, batch_size)
    eval_batch = pipeline.synthetic_batch(bench.dataset, eval_batch_size)
    if topo:  # data parallel: shard_map over the mesh, this process's rows of each batch
        from jax.sharding import PartitionSpec as P

        state = topo.replicate(state)
        train_fn, eval_fn = topo.data_parallel(train_fn, (P(), P())), topo.data_parallel(
            eval_fn, P())
        train_batch, eval_batch = topo.batch_spec(train_batch), topo.batch_spec(eval_batch)
    train = jax.jit(train_fn, donate_argnums=0).lower(state, train_batch).compile()
    evaluate = jax.jit(eval_fn).lower(state, eval_batch).compile()
    to_device = topo.global_batch if topo else (lambda b: b)
    value = topo.local if topo else np.asarray
    mll.end(C.INIT_STOP)

    cleared = data.drop_page_cache(paths.values())
    mll.event(C.CACHE_CLEAR, cleared, metadata={"method": "posix_fadvise DONTNEED"})

    # ---- run: timed from here, once every process has initialized.
    distributed.barrier("run_start")
    t_start = _now_ms()
    mll.start(C.RUN_START, time_ms=t_start)
    splits = pipeline.decode(data.load(bench.dataset, paths))
    train_split, eval_split = splits["train"], splits["eval"]
    if progress:
        progress.start_run(index, seed, cfg.max_epochs, steps)

    evals, status, epoch = [], C.ABORTED, 0
    train_seconds = data_seconds = 0.0
    while epoch < cfg.max_epochs:
        first = epoch + 1
        count = min(bench.eval_every_epochs, cfg.max_epochs - epoch)
        mll.start(C.BLOCK_START, metadata={"first_epoch_num": first, "epoch_count": count})
        for epoch in range(first, first + count):
            mll.start(C.EPOCH_START, metadata={"epoch_num": epoch})
            t0, losses = time.perf_counter(), []
            batches = pipeline.train_batches(train_split.inputs, train_split.labels, batch_size,
                                             seed, epoch, shard=shard)
            while True:
                t_data = time.perf_counter()
                batch = next(batches, None)
                data_seconds += time.perf_counter() - t_data
                if batch is None:
                    break
                state, loss = train(state, to_device(batch))
                losses.append(loss)
                if topo and len(losses) > 2:  # at most two steps in flight: a wait on a
                    with distributed.waiting("a train step"):  # dead peer is seen soon
                        losses[-3].block_until_ready()
                if progress:
                    progress.step()
            with distributed.waiting("the last train step of the epoch"):
                loss = float(np.mean([value(x) for x in losses]))  # waits for the last step
            if topo and cfg.check_replicas:
                topo.check_replicas(state.params)
            train_seconds += time.perf_counter() - t0
            mll.end(C.EPOCH_STOP, metadata={"epoch_num": epoch})

        mll.start(C.EVAL_START, metadata={"epoch_num": epoch})
        total = 0.0
        for b in pipeline.eval_batches(eval_split.inputs, eval_split.labels, eval_batch_size,
                                       shard=shard):
            with distributed.waiting("an eval step"):
                total += float(value(evaluate(state, to_device(b))))
        accuracy = total / len(eval_split.labels)
        mll.end(C.EVAL_STOP, metadata={"epoch_num": epoch})
        mll.event(C.EVAL_ACCURACY, accuracy, metadata={"epoch_num": epoch})
        mll.end(C.BLOCK_STOP, metadata={"first_epoch_num": first})

        elapsed = (_now_ms() - t_start) / 1e3
        evals.append({"epoch": epoch, "accuracy": accuracy, "loss": loss, "time": elapsed})
        if progress:
            progress.epoch_done(epoch, loss, accuracy, epoch * bench.train_size / train_seconds,
                                data_seconds / train_seconds, elapsed)
        if not np.isfinite(loss):
            break  # diverged: no later epoch can reach the target
        if cfg.target is not None and accuracy >= cfg.target:
            status = C.SUCCESS
            break

    t_stop = _now_ms()
    mll.end(C.RUN_STOP, time_ms=t_stop, metadata={"status": status})
    if on_run_end is not None:
        on_run_end(state)
    if progress:
        progress.end_run(status, (t_stop - t_start) / 1e3)
    return RunResult(index=index, seed=seed, status=status, epochs=epoch,
                     time_to_train=(t_stop - t_start) / 1e3, evals=evals,
                     throughput=epoch * bench.train_size / train_seconds,
                     data_fraction=data_seconds / train_seconds, log_path=str(log_path))
