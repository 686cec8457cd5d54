"""``python -m jax_brgemm.train BENCHMARK [options]``: runs, checks, scores, reports."""

import argparse
import dataclasses
import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from . import compliance, data, distributed, report, scoring
from .hparams import HparamError, resolve
from .suite import SUITE, Benchmark

IMPLS = ("brgemm", "xla")
DTYPES = ("float32", "bfloat16")
EXIT_OK, EXIT_NOT_CONVERGED, EXIT_ERROR = 0, 1, 2


class UsageError(Exception):
    """A bad option value or an unusable setup (exit code 2)."""


def _check_impl(impl: str):
    if impl not in IMPLS:
        raise UsageError(f"--impl must be one of {IMPLS}, got {impl!r}")
    if impl == "brgemm":
        try:
            from jax_brgemm import nn  # noqa: F401
        except ImportError as e:
            raise UsageError(f"--impl brgemm needs jax_brgemm's compiled layers, which do not "
                             f"import here ({e}); build/install jax_brgemm, or use --impl xla")


def _reference_result(bench: Benchmark, impl, division, dtype, log_dir: Path):
    """The reference result (seconds) to normalize by, and where it comes from.

    Prefer xla runs measured next to these ones (LOG_DIR/../xla/summary.json, same
    benchmark, division and dtype): same machine, same session. Otherwise the
    recorded reference runs shipped with the suite.
    """
    if impl != "xla":
        sibling = report.read_summary(log_dir.parent / "xla")
        if (sibling and sibling.get("benchmark") == bench.name
                and sibling.get("division") == division and sibling.get("dtype") == dtype
                and sibling["score"]["valid"]):
            return sibling["score"]["value"], f"xla runs in {log_dir.parent / 'xla'}"
    recorded = bench.reference_summary()
    if recorded is None:
        return None, "none recorded"
    return (recorded["result"].value,
            f"recorded xla reference runs (train/reference/{bench.name}.json)")


def _clear_old_results(log_dir: Path):
    # A previous invocation's extra result_<i>.txt would be read as part of this set.
    for pattern in ("result_*.txt", "compliance_*.log", "summary.json", "accuracy.png"):
        for path in log_dir.glob(pattern):
            path.unlink()


def run_benchmark(bench: Benchmark, *, impl: str = "brgemm", division: str = "closed",
                  runs: int = 1, seed: Optional[int] = None, dtype: str = "float32",
                  data_dir=None, log_dir=None, overrides: Mapping[str, Any] = None,
                  config_filename: str = "suite defaults", max_epochs: Optional[int] = None,
                  show_progress: bool = True, out=None, check_replicas: bool = False) -> dict:
    """Validates, runs ``runs`` times, checks every log, scores; returns the summary.

    Raises UsageError, HparamError or data.DataError before anything is trained.

    In a multi-process job (distributed.initialize first), every process calls this with
    the same arguments; only process 0 writes the logs, the summary and the progress.
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
    if seed is not None and seed < 0:
        raise UsageError(f"--seed must not be negative, got {seed}")
    hp = resolve(bench, dict(overrides or {}), division)
    _check_impl(impl)
    paths = data.locate(bench.dataset, data_dir)
    logger = distributed.is_logger()
    if distributed.job() is not None:
        import jax

        if hp["global_batch_size"] % jax.device_count():
            raise UsageError(f"global_batch_size {hp['global_batch_size']} is not divisible by "
                             f"the {jax.device_count()} devices of the job: each takes an "
                             f"equal shard of every batch")

    log_dir = Path(log_dir if log_dir is not None else Path("runs") / bench.name / impl)
    if logger:
        log_dir.mkdir(parents=True, exist_ok=True)
        _clear_old_results(log_dir)
    cfg = loop.RunConfig(bench=bench, impl=impl, division=division, dtype=dtype, hparams=hp,
                         max_epochs=max_epochs, config_filename=config_filename,
                         target=bench.target, check_replicas=check_replicas)
    # System randomness unless a seed is given (then run i uses seed + i); every process
    # of a job uses process 0's.
    seeds = [secrets.randbits(31) if seed is None else seed + i for i in range(runs)]
    seeds = distributed.broadcast_from_0(seeds)
    progress = Progress(runs, f"{bench.name}/{impl}", out) if show_progress and logger else None

    results = []
    for i, run_seed in enumerate(seeds):
        log_path = log_dir / f"result_{i}.txt"
        if not logger:  # the same run, logged by process 0 only
            results.append(loop.run(cfg, i, run_seed, paths, Path(os.devnull), None))
            continue
        result = loop.run(cfg, i, run_seed, paths, log_path, progress)
        result.compliance, output = compliance.run_checker(
            log_path, log_dir / f"compliance_{i}.log", bench.name)
        print(f"  compliance checker on {log_path}: "
              f"{'PASSED' if result.compliance else 'FAILED'}", file=out)
        if not result.compliance:
            print("    " + output.strip().replace("\n", "\n    "), file=out)
        results.append(result)

    if not logger:
        return {"runs": [dataclasses.asdict(r) for r in results]}
    score = scoring.olympic_mean([r.time_to_train if r.converged else math.inf for r in results])
    ref_value, ref_source = _reference_result(bench, impl, division, dtype, log_dir)
    if division == "closed":
        recorded = bench.reference_summary()
        rcp = scoring.rcp_check(recorded and recorded["rcp"], hp["global_batch_size"],
                                [r.epochs if r.converged else math.inf for r in results])
    else:
        rcp = {"status": "n/a", "message": "RCPs apply to the closed division only"}
    summary = {
        "benchmark": bench.name, "impl": impl, "division": division, "dtype": dtype,
        "target": bench.target, "max_epochs": max_epochs, "hparams": hp,
        "compliance_config": compliance.compliance_config(bench.name),
        "data_files": {k: str(v) for k, v in paths.items()},
        "runs": [dataclasses.asdict(r) for r in results],
        "score": dataclasses.asdict(score),
        "official": score.method == "olympic" and runs == bench.num_runs and score.valid,
        "reference": {"result": ref_value, "source": ref_source},
        "normalized_score": scoring.normalized(ref_value, score),
        "rcp": rcp,
    }
    report.write_summary(log_dir, summary)
    print(report.table(summary), file=out)

    series = {impl: [r.evals for r in results]}
    other = "xla" if impl != "xla" else "brgemm"
    sibling = report.read_summary(log_dir.parent / other)
    if sibling and sibling.get("benchmark") == bench.name:
        series[other] = [r["evals"] for r in sibling["runs"]]
    png = report.plot(log_dir / "accuracy.png", series, bench.target,
                      f"{bench.name} ({division}, {dtype})", f"{bench.metric.name} (eval set)")
    print(f"logs, summary.json and {png.name} in {log_dir}", file=out)
    return summary


def exit_code(summary: dict) -> int:
    # compliance is None on the processes other than 0, which do not check logs
    ok = all(r["status"] == "success" and r["compliance"] is not False
             for r in summary["runs"])
    return EXIT_OK if ok else EXIT_NOT_CONVERGED


def build_parser() -> argparse.ArgumentParser:
    benchmarks = "\n".join(f"  {b.name:8s} {b.description}; target {b.metric.name} {b.target:.3f}, "
                           f"at most {b.max_epochs} epochs" for b in SUITE.values())
    parser = argparse.ArgumentParser(
        prog="python -m jax_brgemm.train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MLPerf-style time-to-quality training runs with MLPerf logs.",
        epilog=f"benchmarks:\n{benchmarks}\n\n"
               "Each run writes LOG_DIR/result_<i>.txt (an MLPerf log) and is checked with\n"
               "`python -m mlperf_logging.compliance_checker --config <ruleset>` (the ruleset\n"
               "is jax_brgemm.train.compliance_config(BENCHMARK)); LOG_DIR also gets\n"
               "summary.json and accuracy.png (with the other impl's runs when LOG_DIR's\n"
               "sibling directory for it has a summary.json).\n\n"
               "exit status: 0 every run reached the target and passed the checker,\n"
               "1 some run did not, 2 usage, configuration or data error (nothing trained),\n"
               f"{distributed.EXIT_WORKER_FAILED} a worker of a multi-process job died or hung.\n\n"
               "scale-out: --processes N runs N data-parallel processes on this machine;\n"
               "on several hosts start one process per host (or more) with\n"
               "--coordinator HOST:PORT --num-processes N --process-id I (HOST:PORT of\n"
               "process 0, reachable from every host; all other options the same).")
    parser.add_argument("benchmark", choices=sorted(SUITE), metavar="BENCHMARK",
                        help=f"which benchmark to run: {', '.join(sorted(SUITE))}")
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
                        help="seed of the first run, run i uses S+i (default: each run draws "
                             "its seed from system randomness; seeds are logged)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="compute dtype of the model (parameters stay float32)")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="directory with the dataset's IDX files (.gz or not), searched "
                             f"first; then ${data.ENV_VAR}, then the system directory "
                             "(e.g. /usr/share/datasets/fashion-mnist from the Debian package "
                             "dataset-fashion-mnist); missing files are downloaded into DIR "
                             f"(or ${data.ENV_VAR}, or ~/.cache/jax_brgemm). Every file's "
                             "SHA-256 is verified before use")
    parser.add_argument("--log-dir", metavar="DIR",
                        help="output directory (default runs/BENCHMARK/IMPL); previous "
                             "result_*.txt, compliance_*.log, summary.json, accuracy.png "
                             "there are replaced")
    parser.add_argument("--hparams", metavar="FILE.json",
                        help="JSON object of hyperparameters keyed by MLPerf log names, e.g. "
                             '{"opt_name": "adamw", "opt_base_learning_rate": 0.001, '
                             '"global_batch_size": 512}; unspecified keys keep the reference '
                             "values")
    parser.add_argument("--max-epochs", type=int, default=None, metavar="E",
                        help="stop a run that has not reached the target after E epochs; it "
                             "is logged as aborted (default: the benchmark's limit)")
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


def main(argv=None, worker_command=None) -> int:
    """The CLI. ``worker_command``: what --processes runs for each worker (default: the
    command this process was started with)."""
    args = build_parser().parse_args(argv)
    if args.processes < 1:
        print(f"error: --processes must be at least 1, got {args.processes}", file=sys.stderr)
        return EXIT_ERROR
    if args.processes > 1 and args.coordinator is None:
        if worker_command is None and argv is not None and list(argv) != sys.argv[1:]:
            worker_command = [sys.executable, "-m", "jax_brgemm.train"]  # called from code
        argv = sys.argv[1:] if argv is None else list(argv)
        return distributed.launch(_without_processes(argv), args.processes,
                                  command=worker_command)
    try:
        if args.coordinator is not None:
            _join_job(args)
        overrides = _read_hparams(args.hparams) if args.hparams else {}
        summary = run_benchmark(
            SUITE[args.benchmark], impl=args.impl, division=args.division, runs=args.runs,
            seed=args.seed, dtype=args.dtype, data_dir=args.data_dir, log_dir=args.log_dir,
            overrides=overrides, config_filename=Path(args.hparams).name if args.hparams
            else "suite defaults", max_epochs=args.max_epochs,
            check_replicas=args.check_replicas)
    except (UsageError, HparamError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except distributed.DistributedError as e:
        print(f"error: process {distributed.process_index()}: {e}", file=sys.stderr)
        return distributed.EXIT_WORKER_FAILED
    return exit_code(summary)
