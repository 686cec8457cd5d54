"""``python -m jax_brgemm.train BENCHMARK [options]``: the command line.

It parses the options into a configuration (config.SetConfig) and runs the set
(runner.py: runs, checks, scores, reports), joins or launches a job of several processes
(distributed.py), and turns what went wrong into one line and an exit code. Every
invocation writes a new set directory LOG_DIR/<date>-<time>/ (runner.py lists its files);
``--resume SET`` continues an interrupted set in a new set directory next to it.
Everything that can be wrong with the command line, the data or LOG_DIR is found before
anything is trained or written (exit code 2).
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import jax_brgemm
from jax_brgemm.models import IMPLS

from . import checkpoint, data, distributed, interrupt
from .config import DTYPES, PRECISIONS, SetConfig, UsageError
from .hparams import HparamError
from .runner import run_set
from .suite import SUITE, Suite

EXIT_OK, EXIT_NOT_CONVERGED, EXIT_ERROR = 0, 1, 2


def exit_code(summary: dict) -> int:
    if summary.get("follower"):  # process 0 reports the job's result
        return EXIT_OK
    ok = all(r["status"] == "success" and r["compliance"] for r in summary["runs"])
    return EXIT_OK if ok and summary["score"]["valid"] else EXIT_NOT_CONVERGED


def build_parser(suite: Suite = SUITE) -> argparse.ArgumentParser:
    benchmarks = "\n".join(f"  {b.name:8s} {b.description}; target {b.metric.name} {b.target:.3f}, "
                           f"at most {b.max_epochs} epochs" for b in suite.values())
    parser = argparse.ArgumentParser(
        prog="python -m jax_brgemm.train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MLPerf-style time-to-quality training runs with MLPerf logs.",
        epilog=f"benchmarks:\n{benchmarks}\n\n"
               "Each invocation writes a new set directory LOG_DIR/<date>-<time>/ (earlier\n"
               "sets are kept): result_<i>.txt (an MLPerf log per run, checked with\n"
               "`python -m mlperf_logging.compliance_checker --config <ruleset>`, the ruleset\n"
               "being jax_brgemm.train.compliance_config(BENCHMARK)), config.json,\n"
               "summary.json and accuracy.png (with the newest set of the other impl in\n"
               "LOG_DIR's sibling directory). A closed-division set of the benchmark's full\n"
               "run count gets mlperf_logging's RCP check (scaling.json when it scales).\n\n"
               "SIGINT / SIGTERM stop a run at the next step (final checkpoint with\n"
               "--checkpoint-every, run_stop status aborted in the log).\n\n"
               "exit status: 0 every run reached the target and passed the checker and the\n"
               "result is valid (RCP check included), 1 otherwise, 2 usage, configuration or\n"
               "data error (nothing trained, nothing written), 130 / 143 stopped by SIGINT /\n"
               f"SIGTERM, {distributed.EXIT_WORKER_FAILED} a worker of a multi-process job died or hung.\n\n"
               "scale-out: --processes N runs N data-parallel processes on this machine;\n"
               "on several hosts start the processes with --coordinator HOST:PORT\n"
               "--num-processes N --process-id I (HOST:PORT of process 0, reachable from\n"
               "every host; all other options the same). Process 0 writes the set.")
    parser.add_argument("benchmark", nargs="?", choices=sorted(suite), metavar="BENCHMARK",
                        help=f"which benchmark to run: {', '.join(sorted(suite))} (with "
                             f"--resume: the resumed set's)")
    parser.add_argument("--impl", choices=IMPLS, default="brgemm",
                        help="layers: jax_brgemm's BRGEMM kernels (brgemm, default) or stock "
                             "XLA (xla, the reference implementation)")
    parser.add_argument("--division", choices=("closed", "open"), default="closed",
                        help="closed (default): optimizer and hyperparameters are validated "
                             "against the benchmark's table before anything runs; open: "
                             "anything the harness can build, and the logs say open")
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="number of runs (default 1); the suite's official count is 5, "
                             "scored as the olympic mean (fastest and slowest dropped)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="open division only, for reproduction: seed of the first run, run "
                             "i uses S+i (default, and always in the closed division: each run "
                             "draws its seed from system randomness; seeds and their source "
                             "are logged)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="compute dtype of the model (parameters stay float32)")
    parser.add_argument("--precision", choices=PRECISIONS, default="float32",
                        help="accuracy of the float32 matrix products (--impl brgemm): "
                             "float32 (default), bf16_3x, bf16_6x or bf16, JAX's "
                             "BF16_BF16_F32_X3 / _X6 / BF16_BF16_F32; computed from bfloat16 "
                             "products where jax_brgemm.precision emulates them (AMX; "
                             "JAX_BRGEMM_EMULATE=1|0 forces it), else by exact float32 "
                             "products (jax_brgemm.precision); both are logged"),
    parser.add_argument("--data-dir", metavar="DIR",
                        help="directory holding every IDX file of the dataset (.gz or not); "
                             "nothing else is searched. Without it: the first of "
                             f"${data.ENV_VAR} and the system directory (e.g. "
                             "/usr/share/datasets/fashion-mnist from the Debian package "
                             "dataset-fashion-mnist) that holds every file, else a download "
                             f"into ${data.ENV_VAR} or ~/.cache/jax_brgemm. Every file's "
                             "SHA-256 is verified before use; data in RAM (tmpfs) is refused")
    parser.add_argument("--log-dir", metavar="DIR",
                        help="output directory (default runs/BENCHMARK/IMPL); each invocation "
                             "adds a new set directory DIR/<date>-<time>/, nothing is deleted")
    parser.add_argument("--hparams", metavar="FILE.json",
                        help="JSON object of hyperparameters keyed by MLPerf log names, e.g. "
                             '{"opt_name": "adamw", "opt_base_learning_rate": 0.001, '
                             '"global_batch_size": 512}; unspecified keys keep the reference '
                             "values")
    parser.add_argument("--max-epochs", type=int, default=None, metavar="E",
                        help="stop a run that has not reached the target after E epochs; it "
                             "is logged as aborted (default: the benchmark's limit)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="E",
                        help="save the whole training state (orbax-checkpoint) every E epochs "
                             "and when SIGINT / SIGTERM stop a run, in SET/checkpoints/ "
                             "(default: off)")
    parser.add_argument("--resume", metavar="DIR",
                        help="continue the interrupted set DIR (or the newest set with "
                             "checkpoints in the log directory DIR) from its last complete "
                             "checkpoints, in a new set directory next to it; the benchmark, "
                             "options and seeds are the set's (only --data-dir and "
                             "--checkpoint-every may be given). A resumed run is marked in its "
                             "log and the summary, and is not a valid closed-division timing")
    dist = parser.add_argument_group("scale-out (data parallel, jax.distributed over gloo)")
    dist.add_argument("--processes", type=int, default=1, metavar="N",
                      help="run N worker processes on this machine, each on its share of the "
                           "cores, with a coordinator on a free localhost port (default 1)")
    dist.add_argument("--coordinator", metavar="HOST:PORT",
                      help="join a multi-host job whose process 0 listens on HOST:PORT "
                           "(jax.distributed.initialize); needs --num-processes and "
                           "--process-id")
    dist.add_argument("--num-processes", type=int, metavar="N",
                      help="number of processes of the job (with --coordinator)")
    dist.add_argument("--process-id", type=int, metavar="I",
                      help="this process's index in the job, 0 to N-1; process 0 logs "
                           "(with --coordinator)")
    dist.add_argument("--collective-timeout", type=float,
                      default=distributed.DEFAULT_COLLECTIVE_TIMEOUT, metavar="S",
                      help="a process that waits longer than S seconds for the others (a "
                           "collective, a barrier) ends the job with exit status "
                           f"{distributed.EXIT_WORKER_FAILED} (default %(default).0f)")
    dist.add_argument("--check-replicas", action="store_true",
                      help="debug: after every epoch, check that every process holds the "
                           "same parameters (an error if not)")
    return parser


# Options a resumed set takes from its config.json: option -> config key.
_RESUMED_OPTIONS = {"impl": "impl", "division": "division", "dtype": "dtype",
                    "precision": "precision",
                    "max_epochs": "max_epochs", "hparams": "hparams_file"}


def _resumed_config(args, parser, suite: Suite, on_run_end) -> SetConfig:
    """The configuration that resumes the set --resume names."""
    try:
        found = checkpoint.read_set(checkpoint.find_set(Path(args.resume)))
    except checkpoint.CheckpointError as e:
        raise UsageError(str(e))
    config = found.config
    if args.benchmark not in (None, config["benchmark"]):
        raise UsageError(f"--resume {args.resume}: that set ran {config['benchmark']}, not "
                         f"{args.benchmark}")
    for option in ("runs", "seed", "log_dir", *_RESUMED_OPTIONS):
        if getattr(args, option) != parser.get_default(option) and not (
                option in _RESUMED_OPTIONS and getattr(args, option) == config.get(
                    _RESUMED_OPTIONS[option])):
            raise UsageError(f"--resume takes --{option.replace('_', '-')} from the set it "
                             f"resumes ({found.set_dir / 'config.json'}); leave it out")
    data_dir = args.data_dir or str(Path(next(iter(config["data_files"].values()))).parent)
    return SetConfig(suite[config["benchmark"]], impl=config["impl"],
                     division=config["division"], runs=len(found.seeds), dtype=config["dtype"],
                     precision=config.get("precision", "float32"),
                     data_dir=data_dir, log_dir=found.set_dir.parent,
                     overrides=config["hparams"], hparams_file=config["hparams_file"],
                     max_epochs=config["max_epochs"],
                     checkpoint_every=args.checkpoint_every or found.every, resume=found,
                     suite=suite, on_run_end=on_run_end)


def _without_processes(argv) -> list[str]:
    """argv minus its --processes option (what each worker of --processes N runs)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--processes":
            skip = True
        elif not a.startswith("--processes="):
            out.append(a)
    return out


def _join_job(args) -> None:
    if args.processes != 1:
        raise UsageError("--processes N starts its own job on this machine; with "
                         "--coordinator give --num-processes and --process-id instead")
    if args.num_processes is None or args.process_id is None:
        raise UsageError("--coordinator needs --num-processes N and --process-id I")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        raise UsageError(f"--process-id must be in 0..{args.num_processes - 1} for "
                         f"--num-processes {args.num_processes}, got {args.process_id}")
    if args.collective_timeout <= 0:
        raise UsageError(f"--collective-timeout must be positive, got {args.collective_timeout}")
    distributed.initialize(distributed.JobSpec(args.coordinator, args.num_processes,
                                               args.process_id, args.collective_timeout))


def _read_hparams(path: str) -> dict:
    try:
        overrides = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--hparams {path}: cannot read a JSON object ({e})")
    if not isinstance(overrides, dict):
        raise UsageError(f"--hparams {path}: must hold a JSON object, got "
                         f"{type(overrides).__name__}")
    return overrides


def _main(args, parser, suite: Suite, on_run_end) -> dict:
    if args.coordinator is not None:
        _join_job(args)
    if args.resume:
        return run_set(_resumed_config(args, parser, suite, on_run_end))
    if args.benchmark is None:
        raise UsageError("give a BENCHMARK to run (or --resume DIR)")
    overrides = _read_hparams(args.hparams) if args.hparams else {}
    return run_set(SetConfig(
        suite[args.benchmark], impl=args.impl, division=args.division, runs=args.runs,
        seed=args.seed, dtype=args.dtype, precision=args.precision, data_dir=args.data_dir,
        log_dir=args.log_dir,
        overrides=overrides, hparams_file=args.hparams, max_epochs=args.max_epochs,
        check_replicas=args.check_replicas, checkpoint_every=args.checkpoint_every,
        suite=suite, on_run_end=on_run_end))


def main(argv=None, worker_command=None, *, suite: Suite = SUITE,
         on_run_end: Optional[Callable[[Any], None]] = None) -> int:
    """The CLI. ``worker_command``: what --processes runs for each worker (default: the
    command this process was started with); ``suite``: the benchmarks it offers (a test
    passes its own); ``on_run_end``: called on every process with each run's final
    TrainState (for tests and tools)."""
    parser = build_parser(suite)
    args = parser.parse_args(argv)
    # Both impls train on a heap that keeps freed memory: a step's large buffers reuse warm
    # pages instead of page-faulting fresh ones every step (jax_brgemm.memory).
    jax_brgemm.reuse_freed_memory()
    if args.processes < 1:
        print(f"error: --processes must be at least 1, got {args.processes}", file=sys.stderr)
        return EXIT_ERROR
    if (args.checkpoint_every or args.resume) and (args.processes > 1 or args.coordinator):
        print("error: --checkpoint-every and --resume are single-process only for now "
              "(leave out --processes / --coordinator)", file=sys.stderr)
        return EXIT_ERROR
    if args.processes > 1 and args.coordinator is None:
        if worker_command is None and argv is not None and list(argv) != sys.argv[1:]:
            worker_command = [sys.executable, "-m", "jax_brgemm.train"]  # called from code
        argv = sys.argv[1:] if argv is None else list(argv)
        return distributed.launch(_without_processes(argv), args.processes,
                                  command=worker_command)
    # One process: SIGINT / SIGTERM stop the run at the next step, cleanly. (A worker of
    # a job keeps the default handling: the launcher stops the whole job.)
    signals = interrupt.handling() if args.coordinator is None else contextlib.nullcontext()
    try:
        with signals:
            summary = _main(args, parser, suite, on_run_end)
    except (UsageError, HparamError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except interrupt.Interrupted as e:
        return interrupt.report(e)
    except distributed.DistributedError as e:
        print(f"error: process {distributed.process_index()}: {e}", file=sys.stderr)
        return distributed.EXIT_WORKER_FAILED
    except KeyboardInterrupt:
        if args.coordinator is None:
            raise
        # a worker of a job: the launcher (or the user) stopped it; no traceback per worker
        print(f"process {distributed.process_index()}: interrupted", file=sys.stderr)
        return 128 + 2
    return exit_code(summary)
