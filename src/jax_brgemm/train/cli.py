"""``python -m jax_brgemm.train BENCHMARK [options]``: runs, checks, scores, reports.

Every invocation writes a new set directory, LOG_DIR/<date>-<time>/ (LOG_DIR defaults
to runs/BENCHMARK/IMPL), and never deletes or overwrites earlier sets:

    result_<i>.txt      MLPerf log of run i       compliance_<i>.log  checker output
    config.json         the configuration run (the logs' config_filename)
    summary.json        runs, score, RCP check    accuracy.png        quality vs time
    rcps_<name>.json, rcp_checker.log, scaling.json    the RCP check (closed, full set)
    checkpoints/        with --checkpoint-every E (checkpoint.py)

``--resume SET`` continues an interrupted set in a new set directory next to it.
Everything that can be wrong with the command line, the data or LOG_DIR is found
before anything is trained or written (exit code 2).
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

import jax_brgemm
from jax_brgemm.models import IMPLS

from . import checkpoint, compliance, data, distributed, interrupt, rcp, report, scoring
from .hparams import HparamError, resolve
from .suite import SUITE, Benchmark

DTYPES = ("float32", "bfloat16")
EXIT_OK, EXIT_NOT_CONVERGED, EXIT_ERROR = 0, 1, 2
MAX_SEED = 2**32 - 1
SYSTEM_SEED_SOURCE = "system randomness (secrets.randbits(31), /dev/urandom)"


class UsageError(Exception):
    """A bad option value or an unusable setup (exit code 2)."""


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


def _sibling_summary(log_dir: Path, impl: str) -> Optional[dict]:
    """The newest set's summary of the other impl next to LOG_DIR, if any."""
    other = "xla" if impl != "xla" else "brgemm"
    try:
        return report.latest_summary(log_dir.parent / other)
    except report.SummaryError as e:
        raise UsageError(f"{e}. Fix: move it away, or pass another --log-dir")


def reference_result(bench: Benchmark, impl, division, dtype, sibling: Optional[dict],
                     cpu: str) -> dict:
    """The reference result (seconds) to normalize by: ``{"result", "source", "cpu_model",
    "same_cpu"}``.

    Prefer xla runs measured next to these ones (the newest set in LOG_DIR/../xla,
    same benchmark, division and dtype). Otherwise the recorded reference runs
    shipped with the suite. A reference from another CPU model is reported, not
    normalized against.
    """
    if (impl != "xla" and sibling and sibling["benchmark"] == bench.name
            and sibling["division"] == division and sibling["dtype"] == dtype
            and sibling["score"]["valid"]):
        reference = {"result": sibling["score"]["value"], "cpu_model": sibling["cpu_model"],
                     "source": f"xla runs in {sibling['set']}"}
    elif bench.reference_summary() is not None:
        reference = {"result": bench.reference_summary()["result"].value,
                     "cpu_model": bench.reference().get("cpu_model"),
                     "source": f"recorded xla reference runs (src/jax_brgemm/train/reference/{bench.name}.json)"}
    else:
        return {"result": None, "source": "none recorded", "cpu_model": None, "same_cpu": False}
    return {**reference, "same_cpu": reference["cpu_model"] == cpu}


def new_set_dir(log_dir: Path) -> Path:
    """Creates LOG_DIR/<date>-<time>[-n]: a new directory for this invocation's set."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            set_dir = log_dir / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                set_dir.mkdir()
                return set_dir
            except FileExistsError:
                continue
    except OSError as e:
        raise UsageError(f"--log-dir {log_dir}: cannot create a set directory there "
                         f"({e.strerror or e})")
    raise UsageError(f"--log-dir {log_dir}: too many sets started this second")


def run_benchmark(bench: Benchmark, *, impl: str = "brgemm", division: str = "closed",
                  runs: int = 1, seed: Optional[int] = None, dtype: str = "float32",
                  data_dir=None, log_dir=None, overrides: Mapping[str, Any] = None,
                  hparams_file: Optional[str] = None, max_epochs: Optional[int] = None,
                  show_progress: bool = True, out=None, check_replicas: bool = False,
                  checkpoint_every: int = 0,
                  resume: Optional[checkpoint.SetResume] = None) -> dict:
    """Validates, runs ``runs`` times, checks every log, scores; returns the summary.

    ``checkpoint_every`` E > 0 checkpoints every E epochs; ``resume`` continues that
    interrupted set (its seeds, finished runs and checkpoints) in a new set directory.
    Raises UsageError, HparamError or data.DataError before anything is trained or
    written; interrupt.Interrupted when SIGINT or SIGTERM stops a run.

    In a multi-process job (distributed.initialize first), every process calls this with
    the same arguments; only process 0 writes the set (logs, config, summary) and the
    progress, and checks the logs. Checkpoints are single-process only, for now.
    """
    from . import loop
    from .progress import Progress

    out = out or sys.stdout
    if runs < 1:
        raise UsageError(f"--runs must be at least 1, got {runs}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    max_epochs = bench.max_epochs if max_epochs is None else max_epochs
    if max_epochs < 1:
        raise UsageError(f"--max-epochs must be at least 1, got {max_epochs}")
    if log_dir is not None and str(log_dir).strip() == "":
        raise UsageError("--log-dir must not be empty (leave it out for runs/BENCHMARK/IMPL)")
    if checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be at least 1 (epochs), got "
                         f"{checkpoint_every}")
    # A resumed set keeps the seeds it drew (and logged) at its start.
    run_seeds = resume.seeds if resume else seeds(seed, runs, division)
    hp = resolve(bench, dict(overrides or {}), division)
    if impl not in IMPLS:
        raise UsageError(f"--impl must be one of {IMPLS}, got {impl!r}")
    paths = data.locate(bench.dataset, data_dir)
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
                             [source for _, source in run_seeds]))
        if not distributed.is_logger():
            return _follow(bench, impl, division, dtype, hp, max_epochs, run_seeds, paths,
                           check_replicas)
    log_dir = Path(log_dir if log_dir is not None else Path("runs") / bench.name / impl)
    cpu = loop.cpu_model()
    sibling = _sibling_summary(log_dir, impl)
    reference = reference_result(bench, impl, division, dtype, sibling, cpu)
    cfg = loop.RunConfig(bench=bench, impl=impl, division=division, dtype=dtype, hparams=hp,
                         max_epochs=max_epochs, config_filename="config.json",
                         target=bench.target, check_replicas=check_replicas)
    for i, found in (resume.found.items() if resume else ()):
        if found.loop["config"] != checkpoint.run_config(cfg, run_seeds[i][0]):
            raise UsageError(f"--resume: checkpoint {found.path} is of another run than run "
                             f"{i} of {resume.set_dir / 'config.json'} ({found.loop['config']})")
    if interrupt.requested():
        raise interrupt.Interrupted(interrupt.requested(), "before any run started; nothing "
                                                           "trained, nothing written")
    set_dir = new_set_dir(log_dir)
    if resume:
        print(f"resuming set {resume.set_dir} in the new set {set_dir} (the interrupted set "
              f"is kept as it is)", file=out)

    config = {"benchmark": bench.name, "impl": impl, "division": division, "dtype": dtype,
              "max_epochs": max_epochs, "target": bench.target, "hparams": hp,
              "hparams_file": str(Path(hparams_file).resolve()) if hparams_file else None,
              "data_files": {k: str(v) for k, v in paths.items()}}
    if resume:
        config["resumed_from"] = str(resume.set_dir)
    (set_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if checkpoint_every or resume:
        checkpoint.write_set_file(set_dir, run_seeds, checkpoint_every,
                                  resume.set_dir if resume else None)
    progress = Progress(runs, f"{bench.name}/{impl}", out) if show_progress else None

    results = []
    for i, (run_seed, seed_source) in enumerate(run_seeds):
        log_path = set_dir / f"result_{i}.txt"
        if resume and i in resume.finished:  # finished before the interruption
            checkpoint.carry_over(resume.set_dir, set_dir, i)
            results.append(loop.RunResult(**{**resume.finished[i],
                                             "log_path": str(log_path)}))
            print(f"  run {i}: finished in {resume.set_dir}, carried over", file=out)
            continue
        found = resume.found.get(i) if resume else None
        if found:
            print(f"  run {i}: resumed from {found.path} (epoch "
                  f"{found.loop['position']['next_epoch']}, "
                  f"{found.loop['position']['steps_done']} steps done)", file=out)
        ckpt = checkpoint.RunCheckpoints(set_dir, i, checkpoint_every, found)
        try:
            result = loop.run(cfg, i, run_seed, seed_source, paths, log_path, progress,
                              ckpt)
        except interrupt.Interrupted as e:
            if checkpoint_every:
                e.message += (f". Resume with: python -m jax_brgemm.train --resume "
                              f"{set_dir}")
            raise
        result.compliance, output = compliance.run_checker(
            log_path, set_dir / f"compliance_{i}.log", bench.name)
        print(f"  compliance checker on {log_path}: "
              f"{'PASSED' if result.compliance else 'FAILED'}", file=out)
        if not result.compliance:
            print("    " + output.strip().replace("\n", "\n    "), file=out)
        results.append(result)
        if checkpoint_every or resume:
            checkpoint.write_finished(set_dir, dataclasses.asdict(result))
        if interrupt.requested() and i + 1 < len(run_seeds):
            raise interrupt.Interrupted(interrupt.requested(), (
                f"stopped after run {i} of {len(run_seeds)} (its log is complete)"
                + (f". Resume with: python -m jax_brgemm.train --resume {set_dir}"
                   if checkpoint_every else "")))

    score = scoring.olympic_mean([r.time_to_train if r.converged else math.inf for r in results])
    rcp_check = rcp.check(bench, set_dir, runs, division)
    score = scoring.apply_rcp(score, rcp_check)
    normalized = scoring.normalized(reference["result"], score) if reference["same_cpu"] else None
    resumed = [r.index for r in results if r.resumed]
    summary = {
        "benchmark": bench.name, "impl": impl, "division": division, "dtype": dtype,
        "set": str(set_dir), "cpu_model": cpu, "target": bench.target,
        "max_epochs": max_epochs, "hparams": hp,
        "compliance_config": compliance.compliance_config(bench.name),
        "data_files": config["data_files"],
        "runs": [dataclasses.asdict(r) for r in results],
        "score": dataclasses.asdict(score),
        "official": (division == "closed" and score.method == "olympic" and score.valid
                     and runs == bench.num_runs and rcp_check["status"] == "pass"
                     and not resumed),
        # Runs continued from a checkpoint (their time_to_train adds up the timed parts).
        "resumed": ({"runs": resumed, "from_set": str(resume.set_dir) if resume else None,
                     "note": checkpoint.NOT_VALID_TIMING} if resumed else None),
        "reference": reference,
        "normalized_score": normalized,
        "rcp": rcp_check,
        "final_quality_geomean": scoring.geometric_mean(
            [r.evals[-1]["accuracy"] if r.evals else 0.0 for r in results]),
    }
    report.write_summary(set_dir, summary)
    print(report.table(summary), file=out)

    series = {impl: [r.evals for r in results]}
    if sibling and sibling["benchmark"] == bench.name:
        series["xla" if impl != "xla" else "brgemm"] = [r["evals"] for r in sibling["runs"]]
    png = report.plot(set_dir / "accuracy.png", series, bench.target,
                      f"{bench.name} ({division}, {dtype})", f"{bench.metric.name} (eval set)")
    print(f"set {set_dir}: logs, config.json, summary.json and {png.name}", file=out)
    return summary


def _follow(bench, impl, division, dtype, hp, max_epochs, run_seeds, paths,
            check_replicas) -> dict:
    """A process other than 0 of a job: the same runs, nothing written, nothing checked.
    Its summary holds the runs only, with ``"follower": True``."""
    from . import loop

    cfg = loop.RunConfig(bench=bench, impl=impl, division=division, dtype=dtype, hparams=hp,
                         max_epochs=max_epochs, config_filename="config.json",
                         target=bench.target, check_replicas=check_replicas)
    runs = [loop.run(cfg, i, run_seed, source, paths, Path(os.devnull), None)
            for i, (run_seed, source) in enumerate(run_seeds)]
    return {"follower": True, "runs": [dataclasses.asdict(r) for r in runs]}


def exit_code(summary: dict) -> int:
    if summary.get("follower"):  # process 0 reports the job's result
        return EXIT_OK
    ok = all(r["status"] == "success" and r["compliance"] for r in summary["runs"])
    return EXIT_OK if ok and summary["score"]["valid"] else EXIT_NOT_CONVERGED


def build_parser() -> argparse.ArgumentParser:
    benchmarks = "\n".join(f"  {b.name:8s} {b.description}; target {b.metric.name} {b.target:.3f}, "
                           f"at most {b.max_epochs} epochs" for b in SUITE.values())
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
    parser.add_argument("benchmark", nargs="?", choices=sorted(SUITE), metavar="BENCHMARK",
                        help=f"which benchmark to run: {', '.join(sorted(SUITE))} (with "
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
                    "max_epochs": "max_epochs", "hparams": "hparams_file"}


def _resume_kwargs(args, parser) -> dict:
    """run_benchmark's arguments to resume the set --resume names."""
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
    return dict(bench=SUITE[config["benchmark"]], impl=config["impl"],
                division=config["division"], runs=len(found.seeds), dtype=config["dtype"],
                data_dir=data_dir, log_dir=found.set_dir.parent,
                overrides=config["hparams"], hparams_file=config["hparams_file"],
                max_epochs=config["max_epochs"],
                checkpoint_every=args.checkpoint_every or found.every, resume=found)

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


def _main(args, parser) -> dict:
    if args.coordinator is not None:
        _join_job(args)
    if args.resume:
        return run_benchmark(**_resume_kwargs(args, parser))
    if args.benchmark is None:
        raise UsageError("give a BENCHMARK to run (or --resume DIR)")
    overrides = _read_hparams(args.hparams) if args.hparams else {}
    return run_benchmark(
        SUITE[args.benchmark], impl=args.impl, division=args.division, runs=args.runs,
        seed=args.seed, dtype=args.dtype, data_dir=args.data_dir, log_dir=args.log_dir,
        overrides=overrides, hparams_file=args.hparams, max_epochs=args.max_epochs,
        check_replicas=args.check_replicas, checkpoint_every=args.checkpoint_every)


def main(argv=None, worker_command=None) -> int:
    """The CLI. ``worker_command``: what --processes runs for each worker (default: the
    command this process was started with)."""
    parser = build_parser()
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
            summary = _main(args, parser)
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
