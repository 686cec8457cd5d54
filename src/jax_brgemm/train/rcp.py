"""The RCP check of a set of runs, made by mlperf_logging's own RCP checker.

The benchmark's recorded reference runs (reference/<name>.json) become an RCP file
in mlperf_logging's format, written into the set directory; the checker reads the
set's result_*.txt logs as it reads a submission's. Its verdict decides: a set that
converges faster than the RCP allows fails (the result is rejected); one that
converges faster than the RCP mean but within the allowed range passes with a
scaling factor, which the checker writes to ``scaling.json`` in the set directory
and by which the score is multiplied (MLPerf: "normalize submission run epochs to
reference epochs").
"""

import json
import logging
import math
from pathlib import Path
from unittest import mock

from mlperf_logging.rcp_checker import rcp_checker

RULESET = "6.1.0"


def rcp_file(bench) -> dict:
    """The RCP of ``bench``'s recorded reference runs, in mlperf_logging's RCP format."""
    recorded = bench.reference_summary()
    if recorded is None or recorded["rcp"] is None:
        return {}
    reference = bench.reference()
    epochs = [e for e in recorded["epochs"] if not math.isinf(e)]
    return {f"{bench.name}_ref_{recorded['rcp'].batch_size}": {
        "Benchmark": bench.name, "Creator": "jax_brgemm", "Platform": reference["machine"],
        "Precision": "FP32", "BS": recorded["rcp"].batch_size,
        "Hyperparams": reference["hparams"], "Epochs to converge": epochs}}


def check(bench, set_dir: Path, num_runs: int, division: str) -> dict:
    """The RCP verdict on the set's logs: ``{"status", "message", "scaling_factor"}``.

    status: "pass", "fail", "missing" (no RCP for the benchmark or batch size),
    "no verdict" (fewer runs than a full set) or "n/a" (open division).
    """
    if division != "closed":
        return {"status": "n/a", "message": "RCPs apply to the closed division only",
                "scaling_factor": 1.0}
    if num_runs != bench.num_runs:
        return {"status": "no verdict", "scaling_factor": 1.0,
                "message": f"the RCP check is made on a full set of {bench.num_runs} runs; "
                           f"{num_runs} run(s) give no verdict"}
    records = rcp_file(bench)
    if not records:
        return {"status": "missing", "scaling_factor": 1.0,
                "message": f"no reference convergence point recorded for {bench.name} "
                           f"(run `python -m jax_brgemm.train.reference {bench.name}`)"}
    path = Path(set_dir) / f"rcps_{bench.name}.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    log = logging.getLogger()
    handler = logging.FileHandler(Path(set_dir) / "rcp_checker.log", mode="w")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with mock.patch.dict(rcp_checker.submission_runs["training"],
                             {bench.name: bench.num_runs}), path.open() as f:
            passed, message, factor = rcp_checker.check_directory(
                str(set_dir), "training", RULESET, False, False, rcp_file=f,
                rcp_pass="pruned_rcps", set_scaling=True)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        handler.close()
    if passed:
        status = "pass"
    else:
        status = "missing" if message.startswith(("Missing RCP", "Cannot find")) else "fail"
    factor = float(factor) if passed else 1.0
    if status == "pass":
        message += (f"; faster than the RCP mean within the allowed range: the score is "
                    f"scaled by {factor:.4f} (scaling.json)" if factor > 1 else
                    "; no faster than the RCP mean: the score is not scaled")
    elif message in ("RCP found", "RCP Interpolation"):
        message += ": converges faster than the reference allows; the result is rejected"
    return {"status": status, "message": f"mlperf_logging RCP checker: {message}",
            "scaling_factor": factor}
