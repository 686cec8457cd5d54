"""Olympic scoring, normalization, RCP statistics and the recorded reference runs."""

import math

import numpy as np
import pytest
from mlperf_logging.rcp_checker.rcp_checker import RCP_Checker

from jax_brgemm.train import scoring
from jax_brgemm.train.reference import summarize
from jax_brgemm.train.suite import SUITE

INF = math.inf


def test_olympic_drops_fastest_and_slowest():
    score = scoring.olympic_mean([50.0, 10.0, 30.0, 20.0, 40.0])
    assert score.valid and score.method == "olympic" and score.value == 30.0


def test_one_non_converged_run_is_the_dropped_slowest():
    score = scoring.olympic_mean([10.0, 20.0, INF, 30.0, 40.0])
    assert score.valid and score.value == 30.0  # mean of 20, 30, 40


def test_two_non_converged_runs_make_the_result_invalid():
    score = scoring.olympic_mean([10.0, INF, 20.0, INF, 30.0])
    assert not score.valid and score.value is None and "2 of 5" in score.reason


def test_ties_and_minimum_olympic_size():
    assert scoring.olympic_mean([7.0, 7.0, 7.0]).value == 7.0
    assert scoring.olympic_mean([1.0, 5.0, 9.0]).value == 5.0
    assert scoring.olympic_mean([1.0, INF, 9.0]).value == 9.0


@pytest.mark.parametrize("results, value, valid", [
    ([12.5], 12.5, True),
    ([10.0, 20.0], 15.0, True),
    ([INF], None, False),
    ([10.0, INF], None, False),
    ([], None, False),
])
def test_fewer_than_three_runs_use_a_plain_mean(results, value, valid):
    score = scoring.olympic_mean(results)
    assert score.value == value and score.valid == valid
    assert score.method == ("olympic" if not results else "mean")


def test_normalization_is_reference_over_result():
    assert scoring.normalized(100.0, scoring.olympic_mean([40.0, 50.0, 60.0])) == 2.0
    assert scoring.normalized(None, scoring.olympic_mean([50.0])) is None
    assert scoring.normalized(100.0, scoring.olympic_mean([INF, INF, 1.0])) is None


@pytest.mark.parametrize("epochs", [[10, 11, 11, 12, 13], [8, 9, 12, 12, 15, 16], [5, 5, 6]])
def test_min_epochs_matches_mlperf_rcp_checker(epochs):
    rcp = scoring.make_rcp(256, epochs, submission_runs=5)
    # mlperf_logging's own binary search, on an RCP_Checker without its data files.
    checker = object.__new__(RCP_Checker)
    checker.alpha, checker.tolerance, checker.submission_runs = 0.05, 1e-6, 5
    expected = checker._find_min_acceptable_mean(rcp.mean, rcp.stdev, len(epochs) - 2)
    assert rcp.mean == pytest.approx(np.mean(sorted(epochs)[1:-1]))
    assert rcp.min_epochs == pytest.approx(expected, abs=1e-4)
    assert rcp.min_epochs < rcp.mean


def test_epochs_to_target():
    assert scoring.epochs_to_target([0.5, 0.8, 0.9, 0.95], 0.9) == 3
    assert scoring.epochs_to_target([0.5, 0.8], 0.9) == INF
    assert scoring.epochs_to_target([0.5, 0.95], 0.9, eval_every=2) == 4


# Benchmarks with recorded reference runs (src/jax_brgemm/train/reference/<name>.json).
RECORDED = sorted(n for n in SUITE if SUITE[n].reference() is not None)


def test_the_default_benchmark_has_recorded_reference_runs():
    assert "mlp" in RECORDED


def test_a_benchmark_without_reference_runs_has_no_rcp():
    """Until its reference runs are recorded, a benchmark has no RCP and no reference
    result (the harness then says so instead of passing a check)."""
    for name in sorted(set(SUITE) - set(RECORDED)):
        assert SUITE[name].reference_summary() is None, name


@pytest.mark.parametrize("name", RECORDED)
def test_recorded_reference_supports_the_target(name):
    """The target was chosen so that >= 4 of 5 reference runs reach it in max_epochs."""
    bench = SUITE[name]
    reference = bench.reference()
    assert reference is not None, f"src/jax_brgemm/train/reference/{name}.json is missing"
    assert reference["impl"] == "xla" and reference["dtype"] == "float32"
    assert len(reference["runs"]) >= bench.num_runs
    assert all(len(r["accuracies"]) == bench.max_epochs for r in reference["runs"])
    derived = summarize(bench, reference)
    assert derived["runs_reaching_target"] >= len(reference["runs"]) - 1
    assert derived["reference_result_s"] is not None
    assert derived["rcp"]["global_batch_size"] == bench.hparams["common"]["global_batch_size"]
    # The stored human-readable summary is the one for the current target.
    assert reference["summary"] == derived
