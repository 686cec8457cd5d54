"""Results of a set: SET/summary.json, a printed table, SET/accuracy.png."""

import json
import math
from pathlib import Path
from typing import Optional


def _clean(x):
    """JSON has no infinity: not-converged values are written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_summary(log_dir: Path, summary: dict) -> Path:
    path = Path(log_dir) / "summary.json"
    path.write_text(json.dumps(_clean(summary), indent=2) + "\n")
    return path


class SummaryError(Exception):
    """A summary.json exists but is not one this harness writes."""


# What other sets' summaries must hold to be used (normalization, plots).
_SUMMARY_FIELDS = {"benchmark": str, "division": str, "dtype": str, "set": str,
                   "cpu_model": str, "score": dict, "runs": list}


def read_summary(path: Path) -> dict:
    """Reads a set's summary.json; SummaryError when it is malformed."""
    try:
        summary = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SummaryError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(summary, dict):
        raise SummaryError(f"{path}: not a summary (a JSON {type(summary).__name__})")
    for key, kind in _SUMMARY_FIELDS.items():
        if not isinstance(summary.get(key), kind):
            raise SummaryError(f"{path}: not a summary this harness writes ({key!r} is missing "
                               f"or not a {kind.__name__})")
    if not {"value", "valid"} <= set(summary["score"]) or not all(
            isinstance(r, dict) and isinstance(r.get("evals"), list) for r in summary["runs"]):
        raise SummaryError(f"{path}: not a summary this harness writes (bad score or runs)")
    return summary


def latest_summary(log_dir: Path) -> Optional[dict]:
    """The summary of the newest set directory in ``log_dir`` (sets sort by their
    date-time names), or None when there is none."""
    sets = sorted(p for p in Path(log_dir).glob("*/summary.json") if p.is_file())
    return read_summary(sets[-1]) if sets else None


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(summary: dict) -> str:
    """The runs and the score as text, for the terminal."""
    lines = [f"{summary['benchmark']} ({summary['division']}, impl={summary['impl']}, "
             f"dtype={summary['dtype']}), target {summary['target']:.4f}, set {summary['set']}",
             f"{'run':>3}  {'seed':>10}  {'status':>8}  {'epochs':>6}  {'accuracy':>8}  "
             f"{'time (s)':>8}  {'img/s':>7}  {'data':>5}  compliance"]
    for r in summary["runs"]:
        accuracy = r["evals"][-1]["accuracy"] if r["evals"] else None
        compliance = {True: "pass", False: "FAIL", None: "-"}[r["compliance"]]
        status = r["status"] + ("*" if r.get("resumed") else "")
        lines.append(f"{r['index']:>3}  {r['seed']:>10}  {status:>8}  {r['epochs']:>6}  "
                     f"{_fmt(accuracy, '.4f'):>8}  {r['time_to_train']:>8.1f}  "
                     f"{r['throughput']:>7.0f}  {100 * r['data_fraction']:>4.1f}%  {compliance}")
    lines.append(f"seeds: {summary['runs'][0]['seed_source']}" if summary["runs"] else "")
    if summary.get("resumed"):
        lines.append(f"* resumed from a checkpoint (time: the timed parts added up); "
                     f"{summary['resumed']['note']}")
    s = summary["score"]
    value = "invalid" if s["value"] is None else f"{s['value']:.1f} s"
    method = "olympic mean" if s["method"] == "olympic" else "mean"
    lines.append(f"score ({method} of {len(summary['runs'])} run times): {value}"
                 + (f"  [{s['reason']}]" if s["reason"] else ""))
    lines.append(f"RCP check: {summary['rcp']['status']}: {summary['rcp']['message']}")
    ref = summary["reference"]
    if ref["result"] is not None and ref["same_cpu"]:
        lines.append(f"reference result ({ref['source']}, {ref.get('cpu_kind')}): "
                     f"{ref['result']:.1f} s  ->  normalized score "
                     f"{_fmt(summary['normalized_score'], '.3f')}")
    else:
        recorded = (f"the reference result ({ref['source']}) was recorded on "
                    f"{ref.get('cpu_kind') or 'an unrecorded CPU kind'} ({ref['cpu_model'] or '-'})"
                    if ref["result"] is not None else "no reference result is recorded")
        lines.append(f"WARNING: no normalized score: {recorded}, not on this CPU kind "
                     f"({summary.get('cpu_kind')}, {summary['cpu_model']}); record xla runs here "
                     f"(--impl xla, or python -m jax_brgemm.train.reference "
                     f"{summary['benchmark']}) to normalize")
    if summary["division"] == "open":
        lines.append(f"geometric mean of the final quality: "
                     f"{_fmt(summary['final_quality_geomean'], '.4f')}")
    if not summary["official"]:
        lines.append("not an official result (an official one is a closed-division set of "
                     "the benchmark's run count with a valid score, a passed RCP check and "
                     "no resumed run)")
    return "\n".join(lines)


def plot(path: Path, series: dict, target: float, title: str, ylabel: str) -> Path:
    """Quality (eval_accuracy) vs time since run_start, one line per run, one colour per impl.

    ``series`` maps a label (impl) to a list of runs, each a list of eval dicts.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for color, (label, runs) in zip(["tab:blue", "tab:orange", "tab:green"], series.items()):
        for i, evals in enumerate(runs):
            ax.plot([e["time"] for e in evals], [e["accuracy"] for e in evals], "o-",
                    color=color, alpha=0.7, markersize=3, label=label if i == 0 else None)
    ax.axhline(target, color="gray", linestyle="--", label=f"target {target:.3f}")
    ax.set_xlabel("time since run_start (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
