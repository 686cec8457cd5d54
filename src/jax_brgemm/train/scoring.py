"""Scoring: olympic mean of run times, normalization, reference convergence points.

MLPerf's rules: a benchmark result is the mean of N run results after dropping the
fastest and the slowest; a run that did not converge counts as infinitely slow,
so one may be dropped and more make the result invalid. The normalized score is
reference result / benchmark result. The RCP statistics of the recorded reference
runs are those of mlperf_logging's RCP checker (rcp.py runs that checker on a set).
"""

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
from scipy import stats


@dataclasses.dataclass(frozen=True)
class Score:
    value: Optional[float]      # seconds, None when invalid
    valid: bool
    method: str                 # "olympic" or "mean" (fewer than 3 runs)
    reason: str = ""


def olympic_mean(results: Sequence[float]) -> Score:
    """Olympic mean of run results; ``math.inf`` marks a run that did not converge."""
    n = len(results)
    failed = sum(1 for r in results if math.isinf(r))
    if n == 0:
        return Score(None, False, "olympic", "no runs")
    if n < 3:
        # Too few runs to drop two: a plain mean, valid only if all converged.
        if failed:
            return Score(None, False, "mean", f"{failed} of {n} runs did not converge")
        return Score(float(np.mean(results)), True, "mean", "fewer than 3 runs: plain mean")
    if failed > 1:
        return Score(None, False, "olympic",
                     f"{failed} of {n} runs did not converge (at most one may, as the dropped "
                     f"slowest run)")
    kept = sorted(results)[1:-1]
    return Score(float(np.mean(kept)), True, "olympic")


def apply_rcp(score: Score, rcp_check: dict) -> Score:
    """The score after the RCP verdict: rejected on "fail" or "missing", multiplied by
    the scaling factor on a scaled "pass" (MLPerf's scaling.json), else unchanged."""
    if not score.valid:
        return score
    if rcp_check["status"] in ("fail", "missing"):
        return dataclasses.replace(score, value=None, valid=False,
                                   reason=f"RCP check {rcp_check['status']}")
    factor = rcp_check["scaling_factor"]
    if factor != 1.0:
        return dataclasses.replace(score, value=score.value * factor,
                                   reason=f"scaled by the RCP factor {factor:.4f}")
    return score


def geometric_mean(values: Sequence[float]) -> Optional[float]:
    """Geometric mean (the open division's summary of the final quality of the runs)."""
    if not values:
        return None
    if min(values) <= 0:
        return 0.0
    return float(np.exp(np.mean(np.log(values))))


def normalized(reference: Optional[float], result: Score) -> Optional[float]:
    """reference result / benchmark result: higher is better, 1.0 is the reference."""
    if reference is None or not result.valid or not result.value:
        return None
    return reference / result.value


# --------------------------------------------------------------------------- RCP


@dataclasses.dataclass(frozen=True)
class Rcp:
    """Reference convergence point: epochs to converge of the reference runs."""

    batch_size: int
    epochs: tuple  # epochs to target of each converged reference run
    mean: float    # olympic mean
    stdev: float
    min_epochs: float  # the fewest mean epochs a submission may need


def _trimmed_mean(values):
    values = sorted(values)
    return float(np.mean(values[1:-1] if len(values) >= 3 else values))


def make_rcp(batch_size: int, epochs: Sequence[float], submission_runs: int,
             alpha: float = 0.05) -> Rcp:
    """RCP statistics as in mlperf_logging's RCP checker.

    The smallest acceptable submission mean is the one a one-sided two-sample
    t-test (equal variances, the reference's stdev, olympic sample sizes) does
    not find faster than the reference at level ``alpha``.
    """
    epochs = tuple(sorted(epochs))
    mean, stdev = _trimmed_mean(epochs), float(np.std(epochs))
    n_ref = max(len(epochs) - 2, 1) if len(epochs) >= 3 else len(epochs)
    n_sub = submission_runs - 2 if submission_runs >= 3 else submission_runs
    if stdev == 0:
        min_epochs = mean
    else:
        t_crit = stats.t.ppf(alpha, n_ref + n_sub - 2)  # negative
        min_epochs = mean + t_crit * stdev * math.sqrt(1 / n_ref + 1 / n_sub)
    return Rcp(batch_size, epochs, mean, stdev, min_epochs)


# --------------------------------------------------------------------------- reference


def epochs_to_target(accuracies: Sequence[float], target: float, eval_every: int = 1):
    """Epoch of the first evaluation at or above ``target``, or ``math.inf``."""
    for i, accuracy in enumerate(accuracies):
        if accuracy >= target:
            return (i + 1) * eval_every
    return math.inf


def reference_summary(reference: dict, target: float, eval_every: int, submission_runs: int):
    """Derives from recorded reference curves: epochs/time to ``target`` per run,
    the olympic reference result (seconds) and the RCP."""
    epochs, times = [], []
    for run in reference["runs"]:
        e = epochs_to_target(run["accuracies"], target, eval_every)
        epochs.append(e)
        times.append(math.inf if math.isinf(e) else run["times"][int(e // eval_every) - 1])
    converged = [e for e in epochs if not math.isinf(e)]
    rcp = (make_rcp(reference["hparams"]["global_batch_size"], converged, submission_runs)
           if converged else None)
    return {"epochs": epochs, "times": times, "result": olympic_mean(times), "rcp": rcp,
            "converged": len(converged)}
