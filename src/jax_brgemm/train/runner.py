"""Runs a set: validates, runs every run with MLPerf semantics, checks every log with
the official checker, scores, reports.

Every set is written to a new set directory, LOG_DIR/<date>-<time>/ (LOG_DIR defaults
to runs/BENCHMARK/IMPL), and never deletes or overwrites earlier sets:

    result_<i>.txt      MLPerf log of run i       compliance_<i>.log  checker output
    config.json         the configuration run (the logs' config_filename)
    summary.json        runs, score, RCP check    accuracy.png        quality vs time
    rcps_<name>.json, rcp_checker.log, scaling.json    the RCP check (closed, full set)
    checkpoints/        with checkpoint_every E (checkpoint.py)

Everything that can be wrong with the configuration, the data or LOG_DIR is found
before anything is trained or written.
"""

import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from . import checkpoint, compliance, distributed, interrupt, report, summary
from .config import Checked, SetConfig, UsageError, check
from .suite import SUITE, Benchmark, Suite


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


def run_set(config: SetConfig, out=None) -> dict:
    """Validates, runs ``config.runs`` times, checks every log, scores; returns the summary.

    Raises UsageError, HparamError or data.DataError before anything is trained or
    written; interrupt.Interrupted when SIGINT or SIGTERM stops a run.

    In a multi-process job (distributed.initialize first), every process calls this with
    the same configuration; only process 0 writes the set (logs, config, summary) and the
    progress, and checks the logs. Checkpoints are single-process only, for now.
    """
    from . import loop

    out = out or sys.stdout
    checked = check(config)
    if not distributed.is_logger():
        return _follow(checked)
    c = config
    log_dir = Path(c.log_dir if c.log_dir is not None else Path("runs") / c.bench.name / c.impl)
    cpu, kind = loop.cpu_model(), loop.cpu_kind()
    sibling = summary.sibling_summary(log_dir, c.impl)
    reference = summary.reference_result(c.bench, c.impl, c.division, c.dtype, sibling, kind)
    run_config = checked.run_config()
    for i, found in (c.resume.found.items() if c.resume else ()):
        if found.loop["config"] != checkpoint.run_config(run_config, checked.seeds[i][0]):
            raise UsageError(f"--resume: checkpoint {found.path} is of another run than run "
                             f"{i} of {c.resume.set_dir / 'config.json'} ({found.loop['config']})")
    if interrupt.requested():
        raise interrupt.Interrupted(interrupt.requested(), "before any run started; nothing "
                                                           "trained, nothing written")
    set_dir = new_set_dir(log_dir)
    if c.resume:
        print(f"resuming set {c.resume.set_dir} in the new set {set_dir} (the interrupted set "
              f"is kept as it is)", file=out)
    data_files = _write_config(checked, set_dir)
    results = _run_all(checked, run_config, set_dir, out)
    result = summary.summarize(checked, set_dir, results, reference, cpu, data_files, kind)
    report.write_summary(set_dir, result)
    print(report.table(result), file=out)
    png = summary.plot(checked, set_dir, results, sibling)
    print(f"set {set_dir}: logs, config.json, summary.json and {png.name}", file=out)
    return result


def _write_config(checked: Checked, set_dir: Path) -> dict:
    """Writes SET/config.json (and the checkpoints' set file); returns the data files."""
    c = checked.config
    config = {"benchmark": c.bench.name, "impl": c.impl, "division": c.division,
              "dtype": c.dtype, "precision": c.precision, "max_epochs": checked.max_epochs,
              "target": c.bench.target,
              "hparams": checked.hparams,
              "hparams_file": str(Path(c.hparams_file).resolve()) if c.hparams_file else None,
              "data_files": {k: str(v) for k, v in checked.paths.items()}}
    if c.resume:
        config["resumed_from"] = str(c.resume.set_dir)
    (set_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if c.checkpoint_every or c.resume:
        checkpoint.write_set_file(set_dir, checked.seeds, c.checkpoint_every,
                                  c.resume.set_dir if c.resume else None)
    return config["data_files"]


def _run_all(checked: Checked, run_config, set_dir: Path, out) -> list:
    """Every run of the set (finished runs of a resumed set carried over), each log
    checked by the official checker; stops between runs on SIGINT / SIGTERM."""
    from . import loop
    from .progress import Progress

    c, resume = checked.config, checked.config.resume
    progress = Progress(c.runs, f"{c.bench.name}/{c.impl}", out) if c.show_progress else None
    resume_hint = f". Resume with: python -m jax_brgemm.train --resume {set_dir}"
    results = []
    for i, (run_seed, seed_source) in enumerate(checked.seeds):
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
        ckpt = checkpoint.RunCheckpoints(set_dir, i, c.checkpoint_every, found)
        try:
            result = loop.run(run_config, i, run_seed, seed_source, checked.paths, log_path,
                              progress, ckpt)
        except interrupt.Interrupted as e:
            if c.checkpoint_every:
                e.message += resume_hint
            raise
        result.compliance, output = compliance.run_checker(
            log_path, set_dir / f"compliance_{i}.log", c.bench.name, c.suite)
        print(f"  compliance checker on {log_path}: "
              f"{'PASSED' if result.compliance else 'FAILED'}", file=out)
        if not result.compliance:
            print("    " + output.strip().replace("\n", "\n    "), file=out)
        results.append(result)
        if c.checkpoint_every or resume:
            checkpoint.write_finished(set_dir, dataclasses.asdict(result))
        if interrupt.requested() and i + 1 < len(checked.seeds):
            raise interrupt.Interrupted(interrupt.requested(), (
                f"stopped after run {i} of {len(checked.seeds)} (its log is complete)"
                + (resume_hint if c.checkpoint_every else "")))
    return results


def _follow(checked: Checked) -> dict:
    """A process other than 0 of a job: the same runs, nothing written, nothing checked.
    Its summary holds the runs only, with ``"follower": True``."""
    from . import loop

    run_config = checked.run_config()
    runs = [loop.run(run_config, i, run_seed, source, checked.paths, Path(os.devnull), None)
            for i, (run_seed, source) in enumerate(checked.seeds)]
    return {"follower": True, "runs": [dataclasses.asdict(r) for r in runs]}


def run_benchmark(bench: Benchmark, *, impl: str = "brgemm", division: str = "closed",
                  runs: int = 1, seed: Optional[int] = None, dtype: str = "float32",
                  data_dir=None, log_dir=None, overrides: Mapping[str, Any] = None,
                  hparams_file: Optional[str] = None, max_epochs: Optional[int] = None,
                  show_progress: bool = True, out=None, check_replicas: bool = False,
                  checkpoint_every: int = 0,
                  resume: Optional[checkpoint.SetResume] = None, suite: Suite = SUITE,
                  on_run_end: Optional[Callable[[Any], None]] = None) -> dict:
    """Runs a set of ``bench`` (see SetConfig for the options) and returns its summary.

    ``checkpoint_every`` E > 0 checkpoints every E epochs; ``resume`` continues that
    interrupted set (its seeds, finished runs and checkpoints) in a new set directory;
    ``suite``: the suite whose rules check the logs (a benchmark of one's own comes with
    a suite of its own).
    """
    return run_set(SetConfig(
        bench, impl=impl, division=division, runs=runs, seed=seed, dtype=dtype,
        data_dir=data_dir, log_dir=log_dir, overrides=overrides, hparams_file=hparams_file,
        max_epochs=max_epochs, show_progress=show_progress, check_replicas=check_replicas,
        checkpoint_every=checkpoint_every, resume=resume, suite=suite,
        on_run_end=on_run_end), out)
