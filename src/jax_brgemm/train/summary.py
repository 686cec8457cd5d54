"""What a finished set adds up to: score, RCP check, reference and normalized score
(SET/summary.json), and the accuracy plot against the other impl's newest set."""

import dataclasses
import math
from pathlib import Path
from typing import Optional

from . import checkpoint, compliance, rcp, report, scoring
from .config import Checked, UsageError
from .suite import Benchmark


def other_impl(impl: str) -> str:
    return "xla" if impl != "xla" else "brgemm"


def sibling_summary(log_dir: Path, impl: str) -> Optional[dict]:
    """The newest set's summary of the other impl next to LOG_DIR, if any."""
    try:
        return report.latest_summary(log_dir.parent / other_impl(impl))
    except report.SummaryError as e:
        raise UsageError(f"{e}. Fix: move it away, or pass another --log-dir")


def reference_result(bench: Benchmark, impl, division, dtype, sibling: Optional[dict],
                     kind: str) -> dict:
    """The reference result (seconds) to normalize by: ``{"result", "source", "cpu_model",
    "cpu_kind", "same_cpu"}``; ``kind`` is this CPU's (loop.cpu_kind()).

    Prefer xla runs measured next to these ones (the newest set in LOG_DIR/../xla,
    same benchmark, division and dtype). Otherwise the recorded reference runs
    shipped with the suite for this CPU kind, else any recorded ones. A reference
    from another CPU kind (or of no recorded kind) is reported, not normalized against.
    """
    recorded = bench.reference_for(kind) or bench.reference()
    if (impl != "xla" and sibling and sibling["benchmark"] == bench.name
            and sibling["division"] == division and sibling["dtype"] == dtype
            and sibling["score"]["valid"]):
        reference = {"result": sibling["score"]["value"], "cpu_model": sibling["cpu_model"],
                     "cpu_kind": sibling.get("cpu_kind"), "source": f"xla runs in {sibling['set']}"}
    elif recorded is not None:
        where = f"{kind}/" if (Path(bench.reference_dir) / kind / f"{bench.name}.json").exists() else ""
        reference = {"result": bench.reference_summary(recorded)["result"].value,
                     "cpu_model": recorded.get("cpu_model"), "cpu_kind": recorded.get("cpu_kind"),
                     "source": f"recorded xla reference runs "
                               f"(src/jax_brgemm/train/reference/{where}{bench.name}.json)"}
    else:
        return {"result": None, "source": "none recorded", "cpu_model": None, "cpu_kind": None,
                "same_cpu": False}
    return {**reference, "same_cpu": reference["cpu_kind"] == kind}


def summarize(checked: Checked, set_dir: Path, results: list, reference: dict, cpu: str,
              data_files: dict, kind: Optional[str] = None) -> dict:
    """The set's summary: its runs, the score (olympic mean, RCP-scaled), whether it is
    an official result, the reference and the normalized score."""
    c = checked.config
    bench = c.bench
    score = scoring.olympic_mean([r.time_to_train if r.converged else math.inf for r in results])
    rcp_check = rcp.check(bench, set_dir, c.runs, c.division)
    score = scoring.apply_rcp(score, rcp_check)
    normalized = scoring.normalized(reference["result"], score) if reference["same_cpu"] else None
    resumed = [r.index for r in results if r.resumed]
    return {
        "benchmark": bench.name, "impl": c.impl, "division": c.division, "dtype": c.dtype,
        "set": str(set_dir), "cpu_model": cpu, "cpu_kind": kind, "target": bench.target,
        "max_epochs": checked.max_epochs, "hparams": checked.hparams,
        "compliance_config": compliance.compliance_config(bench.name, c.suite),
        "data_files": data_files,
        "runs": [dataclasses.asdict(r) for r in results],
        "score": dataclasses.asdict(score),
        "official": (c.division == "closed" and score.method == "olympic" and score.valid
                     and c.runs == bench.num_runs and rcp_check["status"] == "pass"
                     and not resumed),
        # Runs continued from a checkpoint (their time_to_train adds up the timed parts).
        "resumed": ({"runs": resumed, "from_set": str(c.resume.set_dir) if c.resume else None,
                     "note": checkpoint.NOT_VALID_TIMING} if resumed else None),
        "reference": reference,
        "normalized_score": normalized,
        "rcp": rcp_check,
        "final_quality_geomean": scoring.geometric_mean(
            [r.evals[-1]["accuracy"] if r.evals else 0.0 for r in results]),
    }


def plot(checked: Checked, set_dir: Path, results: list, sibling: Optional[dict]) -> Path:
    """SET/accuracy.png: the runs' quality against time, with the other impl's newest set."""
    c = checked.config
    series = {c.impl: [r.evals for r in results]}
    if sibling and sibling["benchmark"] == c.bench.name:
        series[other_impl(c.impl)] = [r["evals"] for r in sibling["runs"]]
    return report.plot(set_dir / "accuracy.png", series, c.bench.target,
                       f"{c.bench.name} ({c.division}, {c.dtype})",
                       f"{c.bench.metric.name} (eval set)")
