"""Records a benchmark's reference runs: ``python -m jax_brgemm.train.reference NAME``.

Runs the reference implementation (impl="xla", float32, closed-division default
hyperparameters) for the full ``max_epochs`` without stopping at the target, and
stores every run's accuracy curve in reference/<kind>/<name>.json (the benchmark's
``reference_dir``; <kind> this CPU's vendor, family, model and kernel ISA, loop.cpu_kind()):
its time to target normalizes runs on that CPU kind only. The reference convergence points
come from reference/<name>.json's curves (epochs do not depend on the CPU). Everything the
harness needs is derived from those curves for the suite's current target:
epochs to target per run (the reference convergence points), the reference
result (olympic mean time to target) and whether at least 4 of 5 runs reach the
target within max_epochs (the criterion the target was chosen by).
"""

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import jax_brgemm

from . import data, scoring
from .config import UsageError, seeds
from .hparams import resolve
from .runner import new_set_dir
from .suite import SUITE, Suite


def summarize(bench, reference: dict) -> dict:
    """Human-readable derived numbers for the suite's current target."""
    derived = scoring.reference_summary(reference, bench.target, bench.eval_every_epochs,
                                        bench.num_runs)
    rcp = derived["rcp"]
    return {
        "target": bench.target,
        "epochs_to_target": [None if math.isinf(e) else e for e in derived["epochs"]],
        "time_to_target_s": [None if math.isinf(t) else round(t, 1) for t in derived["times"]],
        "runs_reaching_target": derived["converged"],
        "reference_result_s": derived["result"].value,
        "rcp": None if rcp is None else {"global_batch_size": rcp.batch_size,
                                         "epochs_to_converge": list(rcp.epochs),
                                         "mean": rcp.mean, "stdev": rcp.stdev,
                                         "min_epochs": rcp.min_epochs},
    }


def record(bench, runs: int, seed, data_dir, log_dir: Path) -> dict:
    from . import loop
    from .progress import Progress

    hp = resolve(bench, {}, "closed")
    paths = data.locate(bench.dataset, data_dir)
    # Closed-division hyperparameters; a fixed seed makes the logs say open (seed rule).
    division = "closed" if seed is None else "open"
    run_seeds = seeds(seed, runs, division)
    cfg = loop.RunConfig(bench=bench, impl="xla", division=division, dtype="float32",
                         hparams=hp, max_epochs=bench.max_epochs, config_filename="config.json",
                         target=None)
    log_dir = new_set_dir(log_dir)
    (log_dir / "config.json").write_text(json.dumps(
        {"benchmark": bench.name, "impl": "xla", "division": division, "dtype": "float32",
         "max_epochs": bench.max_epochs, "hparams": hp, "reference_runs": runs}, indent=2) + "\n")
    progress = Progress(runs, f"{bench.name}/reference")
    curves = []
    for i, (run_seed, source) in enumerate(run_seeds):
        result = loop.run(cfg, i, run_seed, source, paths, log_dir / f"result_{i}.txt", progress)
        curves.append({"seed": run_seed,
                       "accuracies": [e["accuracy"] for e in result.evals],
                       "times": [round(e["time"], 2) for e in result.evals],
                       "losses": [round(e["loss"], 5) for e in result.evals]})
    return {
        "benchmark": bench.name, "impl": "xla", "dtype": "float32", "division": "closed",
        "hparams": hp, "max_epochs": bench.max_epochs,
        "eval_every_epochs": bench.eval_every_epochs,
        "machine": loop.platform_name(), "cpu_model": loop.cpu_model(), "cpu_kind": loop.cpu_kind(),
        "software": loop.software_versions(), "git_commit": loop.source_commit(),
        "date": datetime.date.today().isoformat(),
        "command": "python -m jax_brgemm.train.reference " + " ".join(sys.argv[1:]),
        "runs": curves,
    }


def main(argv=None, suite: Suite = SUITE) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_brgemm.train.reference",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=sorted(suite))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the first run (default: system randomness); the logs "
                             "then say open division (closed-division runs use system seeds)")
    parser.add_argument("--data-dir")
    parser.add_argument("--log-dir", help="default runs/BENCHMARK/reference")
    parser.add_argument("--summarize", action="store_true",
                        help="do not run: print the summary of the stored runs for the "
                             "suite's current target")
    args = parser.parse_args(argv)
    bench = suite[args.benchmark]
    from . import loop

    path = Path(bench.reference_dir) / loop.cpu_kind() / f"{bench.name}.json"
    if args.summarize:
        reference = bench.reference_for(loop.cpu_kind()) or bench.reference()
        if reference is None:
            print(f"no reference runs recorded in {path}", file=sys.stderr)
            return 2
    else:
        log_dir = Path(args.log_dir or Path("runs") / bench.name / "reference")
        jax_brgemm.reuse_freed_memory()  # the heap the harness trains on (cli.main)
        try:
            reference = record(bench, args.runs, args.seed, args.data_dir, log_dir)
        except (UsageError, data.DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    reference["summary"] = summarize(bench, reference)
    if not args.summarize:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(reference, indent=1) + "\n")
        print(f"wrote {path}")
    print(json.dumps(reference["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
