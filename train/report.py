"""Results: LOG_DIR/summary.json, a printed table, LOG_DIR/accuracy.png."""

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


def read_summary(log_dir: Path) -> Optional[dict]:
    path = Path(log_dir) / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(summary: dict) -> str:
    """The runs and the score as text, for the terminal."""
    lines = [f"{summary['benchmark']} ({summary['division']}, impl={summary['impl']}, "
             f"dtype={summary['dtype']}), target {summary['target']:.4f}",
             f"{'run':>3}  {'seed':>10}  {'status':>8}  {'epochs':>6}  {'accuracy':>8}  "
             f"{'time (s)':>8}  {'img/s':>7}  {'data':>5}  compliance"]
    for r in summary["runs"]:
        accuracy = r["evals"][-1]["accuracy"] if r["evals"] else None
        compliance = {True: "pass", False: "FAIL", None: "-"}[r["compliance"]]
        lines.append(f"{r['index']:>3}  {r['seed']:>10}  {r['status']:>8}  {r['epochs']:>6}  "
                     f"{_fmt(accuracy, '.4f'):>8}  {r['time_to_train']:>8.1f}  "
                     f"{r['throughput']:>7.0f}  {100 * r['data_fraction']:>4.1f}%  {compliance}")
    s = summary["score"]
    value = "invalid" if s["value"] is None else f"{s['value']:.1f} s"
    method = "olympic mean" if s["method"] == "olympic" else "mean"
    lines.append(f"score ({method} of {len(summary['runs'])} run times): {value}"
                 + (f"  [{s['reason']}]" if s["reason"] else ""))
    ref = summary["reference"]
    if ref["result"] is not None:
        lines.append(f"reference result ({ref['source']}): {ref['result']:.1f} s  ->  normalized "
                     f"score {_fmt(summary['normalized_score'], '.3f')}")
    lines.append(f"RCP check: {summary['rcp']['status']}: {summary['rcp']['message']}")
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
