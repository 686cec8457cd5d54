"""Checkpoints of runs (orbax-checkpoint) and resuming an interrupted set from them.

With ``--checkpoint-every E`` a set directory gets

    SET/checkpoints/set.json            the runs' seeds, E, the set resumed from (if any)
    SET/checkpoints/run_<i>/<step>/     orbax checkpoints of run i, named by train step:
        state/  the whole TrainState (parameters, optimizer state, model state such as
                BatchNorm statistics, step count) as arrays
        loop/   JSON: where the run is (epoch, steps done in it, open evaluation block,
                the epoch's losses so far), its evaluations, the elapsed run time, the
                data-order and RNG state (seed; epoch e's order is drawn from [seed, e];
                the model's init key), the MLPerf log lines written so far, and what the
                run is (benchmark, impl, division, dtype, hyperparameters) to refuse a
                mismatched resume
    SET/checkpoints/run_<i>.json        the result of run i once it has finished

A checkpoint is saved after the evaluation closing a block in which an epoch that is a
multiple of E ended, and on SIGINT / SIGTERM at the step where the run stops. Orbax
writes a step into ``<step>.orbax-checkpoint-tmp-<time>/``, writes its commit marker
(commit_success.txt) and renames it (atomic on local disks); a step counts as complete
only under its final name *and* with the marker in it and in each item, so an
interrupted save is never loaded.

``--resume DIR`` continues a set in a new set directory next to it (the interrupted set
is kept as it is): finished runs are carried over, the interrupted run continues from
its newest complete checkpoint (its log = the interrupted log's lines up to that
checkpoint + a ``run_resumed`` event + the rest), runs not begun start fresh with the
seeds the set drew at its start.
"""

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

CHECKPOINTS = "checkpoints"
SET_FILE = "set.json"
COMMIT_MARKER = "commit_success.txt"  # orbax's; written just before a step is finalized
FORMAT = 1
ITEMS = ("state", "loop")
KEEP = 2  # complete checkpoints kept per run
DATA_ORDER = "epoch e: numpy default_rng([seed, e]).permutation(train examples)"
RESUMED_KEY = "run_resumed"  # the MLPerf log event of a resumed run (not an MLPerf key)
NOT_VALID_TIMING = ("a resumed run is not a valid closed-division timing: MLPerf's run is "
                    "one complete execution from initialization to the quality target, timed "
                    "by wallclock from run_start to run_stop")


class CheckpointError(Exception):
    """Nothing to resume from, or checkpoints of another configuration (exit code 2)."""


@dataclasses.dataclass
class Position:
    """Where a run stands, between two train steps.

    Attributes:
      next_epoch: the epoch to train or to continue.
      steps_done: steps of ``next_epoch`` already trained (0: not begun, its
        epoch_start not logged).
      block_first: first epoch of the open evaluation block (its block_start logged),
        None at a block boundary.
      losses: the train losses of ``next_epoch``'s steps done.
      evals: the run's evaluations so far (``{"epoch", "accuracy", "loss", "time"}``).
      train_seconds, data_seconds: the throughput counters.
    """

    next_epoch: int = 1
    steps_done: int = 0
    block_first: Optional[int] = None
    losses: list = dataclasses.field(default_factory=list)
    evals: list = dataclasses.field(default_factory=list)
    train_seconds: float = 0.0
    data_seconds: float = 0.0


def _ocp():
    import orbax.checkpoint as ocp  # heavy (tensorstore): only when checkpointing

    return ocp


def _manager(directory: Path, read_only: bool = False):
    """Orbax's manager of a run's checkpoints; ``read_only``: for restoring (it neither
    creates nor deletes anything: nothing is saved through it)."""
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(max_to_keep=None if read_only else KEEP,
                                           create=not read_only,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory, options=options)


def complete_steps(directory: Path) -> list[int]:
    """The steps of ``directory`` that are complete checkpoints, oldest first: a final
    name (orbax's temporaries carry a suffix, ``<step>.orbax-checkpoint-tmp-<time>``) and
    orbax's commit marker in the step and in each of its items."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(path.name) for path in directory.iterdir()
                  if path.is_dir() and path.name.isdigit()
                  and all((path / sub / COMMIT_MARKER).is_file() for sub in (".", *ITEMS)))


def _state_arrays(state) -> dict:
    import jax

    return {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))}


def _state_paths(state) -> list[str]:
    import jax

    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def run_config(cfg, seed: int) -> dict:
    """What a checkpoint must match to be resumed: the run's configuration and seed."""
    return {"benchmark": cfg.bench.name, "impl": cfg.impl, "division": cfg.division,
            "dtype": cfg.dtype, "hparams": dict(cfg.hparams), "max_epochs": cfg.max_epochs,
            "target": cfg.target, "seed": seed}


@dataclasses.dataclass
class Found:
    """A complete checkpoint to resume from."""

    path: Path           # SET/checkpoints/run_<i>/<step>
    step: int
    loop: dict           # the loop/ item
    set_dir: Path        # the set whose log it belongs to


class RunCheckpoints:
    """The checkpoints of run ``index`` of a set: saving every ``every`` epochs (0: only
    none) and, with ``resume``, the checkpoint it continues from."""

    def __init__(self, set_dir: Path, index: int, every: int, resume: Optional[Found] = None):
        self.set_dir, self.index, self.every, self.resume = Path(set_dir), index, every, resume
        self.directory = self.set_dir / CHECKPOINTS / f"run_{index}"
        self._manager = None
        self.saved: Optional[Path] = None

    @property
    def enabled(self) -> bool:
        return self.every > 0

    @property
    def position(self) -> Optional[Position]:
        return Position(**self.resume.loop["position"]) if self.resume else None

    def due(self, epochs: range) -> bool:
        """Whether a periodic checkpoint is due after a block of these epochs."""
        return self.enabled and any(e % self.every == 0 for e in epochs)

    def save(self, state, pos: Position, *, config: dict, seed_source: str, log_path: Path,
             elapsed: float, reason: str, resumes: list) -> Path:
        """Saves the run at ``pos`` (synchronously: complete when this returns)."""
        import jax

        ocp = _ocp()
        if self._manager is None:
            self._manager = _manager(self.directory)
        log_lines = _count_lines(log_path)
        loop = {
            "format": FORMAT, "config": config, "seed_source": seed_source,
            "position": dataclasses.asdict(dataclasses.replace(
                pos, losses=[float(x) for x in pos.losses])),
            "elapsed": elapsed, "reason": reason, "saved_at": time.time(),
            "data_order": {"scheme": DATA_ORDER, "seed": config["seed"],
                           "next_epoch": pos.next_epoch, "steps_done": pos.steps_done},
            "model_rng": {"init": "jax.random.key(seed)", "key_data": np.asarray(
                jax.random.key_data(jax.random.key(config["seed"]))).tolist()},
            "log_file": log_path.name, "log_lines": log_lines, "resumes": resumes,
            "state_paths": _state_paths(state),
        }
        step = int(np.asarray(state.step))
        if step in self._manager.all_steps():  # e.g. a signal right after a periodic save
            self.saved = self.directory / str(step)
            return self.saved
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_state_arrays(state)), loop=ocp.args.JsonSave(loop)))
        self._manager.wait_until_finished()
        self.saved = self.directory / str(step)
        return self.saved

    def restore(self, state):
        """``state`` (freshly created, of the same structure) with the checkpoint's values."""
        import jax

        ocp = _ocp()
        found = self.resume
        if found.loop["state_paths"] != _state_paths(state):
            raise CheckpointError(f"{found.path}: its training state has another structure "
                                  f"than this run's model and optimizer")
        manager = _manager(found.path.parent, read_only=True)
        try:
            restored = manager.restore(found.step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_state_arrays(state))))["state"]
        finally:
            manager.close()
        leaves = [restored[f"leaf_{i:05d}"] for i in range(len(restored))]
        treedef = jax.tree.structure(state)
        return jax.tree.unflatten(treedef, [jax.numpy.asarray(x) for x in leaves])

    def write_log_prefix(self, log_path: Path) -> None:
        """Starts ``log_path`` with the interrupted log's lines up to the checkpoint."""
        found = self.resume
        source = found.set_dir / found.loop["log_file"]
        with open(source) as f:
            lines = [line for _, line in zip(range(found.loop["log_lines"]), f)]
        if len(lines) != found.loop["log_lines"]:
            raise CheckpointError(f"{source}: shorter than when {found.path} was saved")
        Path(log_path).write_text("".join(lines))

    def close(self):
        if self._manager is not None:
            self._manager.close()
            self._manager = None


# --------------------------------------------------------------------------- sets


def write_set_file(set_dir: Path, seeds: list, every: int, resumed_from: Optional[Path]):
    directory = Path(set_dir) / CHECKPOINTS
    directory.mkdir(exist_ok=True)
    record = {"format": FORMAT, "seeds": [list(s) for s in seeds], "checkpoint_every": every,
              "resumed_from": str(resumed_from) if resumed_from else None}
    (directory / SET_FILE).write_text(json.dumps(record, indent=2) + "\n")


def write_finished(set_dir: Path, result: Mapping[str, Any]) -> None:
    """Records a finished run (its RunResult as a dict), for resuming the set."""
    path = Path(set_dir) / CHECKPOINTS / f"run_{result['index']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def find_set(path: Path) -> Path:
    """The set directory to resume: ``path`` itself when it is a set with checkpoints,
    else the newest set in ``path`` that has them."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"--resume {path}: no such directory")
    if (path / CHECKPOINTS / SET_FILE).is_file():
        return path
    sets = sorted(p.parent.parent for p in path.glob(f"*/{CHECKPOINTS}/{SET_FILE}"))
    if sets:
        return sets[-1]
    if (path / "config.json").is_file():
        raise CheckpointError(f"--resume {path}: this set has no checkpoints (it was run "
                              f"without --checkpoint-every)")
    raise CheckpointError(f"--resume {path}: neither a set directory with checkpoints nor a "
                          f"log directory holding one (run with --checkpoint-every E)")


@dataclasses.dataclass
class SetResume:
    """What resuming a set needs: its configuration, seeds and per-run starting points."""

    set_dir: Path
    config: dict
    seeds: list
    every: int
    finished: dict       # run index -> RunResult dict
    found: dict          # run index -> Found (runs interrupted after a complete checkpoint)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read it ({e})") from e


def latest(set_dir: Path, index: int) -> Optional[Found]:
    """The newest complete checkpoint of run ``index`` in this set or, when it has none,
    in the set it was resumed from (and so on)."""
    seen = set()
    set_dir = Path(set_dir)
    while set_dir and set_dir not in seen:
        seen.add(set_dir)
        directory = set_dir / CHECKPOINTS / f"run_{index}"
        for step in reversed(complete_steps(directory)):
            loop = _read_json(directory / str(step) / "loop" / "metadata")
            if loop.get("format") == FORMAT:
                return Found(directory / str(step), step, loop, set_dir)
        record = _read_json(set_dir / CHECKPOINTS / SET_FILE)
        set_dir = Path(record["resumed_from"]) if record.get("resumed_from") else None
    return None


def _count_lines(path: Path) -> int:
    """Lines of ``path``; -1 when it cannot be read."""
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:
        return -1


def read_set(set_dir: Path) -> SetResume:
    set_dir = Path(set_dir)
    record = _read_json(set_dir / CHECKPOINTS / SET_FILE)
    config = _read_json(set_dir / "config.json")
    finished, found = {}, {}
    for i in range(len(record["seeds"])):
        path = set_dir / CHECKPOINTS / f"run_{i}.json"
        if path.is_file():
            finished[i] = _read_json(path)
        else:
            hit = latest(set_dir, i)
            if hit is not None:
                log = hit.set_dir / hit.loop["log_file"]
                if _count_lines(log) < hit.loop["log_lines"]:
                    raise CheckpointError(f"{hit.path} continues the MLPerf log {log}, which "
                                          f"is missing or shorter than when it was saved")
                found[i] = hit
    return SetResume(set_dir, config, [tuple(s) for s in record["seeds"]],
                     record["checkpoint_every"], finished, found)


def carry_over(old: Path, new: Path, index: int) -> None:
    """Copies finished run ``index``'s log, checker output and result into set ``new``."""
    for name in (f"result_{index}.txt", f"compliance_{index}.log",
                 f"{CHECKPOINTS}/run_{index}.json"):
        if (Path(old) / name).is_file():
            shutil.copy2(Path(old) / name, Path(new) / name)
