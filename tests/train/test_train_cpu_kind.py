"""The normalized score compares like with like: a reference counts only if it was recorded
on the same CPU kind (vendor, family, model, kernel ISA), never by the model-name string."""

import dataclasses
import json

from jax_brgemm.train import loop, report
from jax_brgemm.train.suite import SUITE
from jax_brgemm.train.summary import reference_result

XEON = "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: {model}\nmodel name\t: Intel(R) Xeon(R) Processor\n\n"
ZEN4 = "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9R14\n\n"


def test_cpu_kind_tells_apart_cpus_with_one_model_name():
    assert loop.cpu_kind(XEON.format(model=167), "amx") == "intel-6-167-amx"
    assert loop.cpu_kind(XEON.format(model=207), "amx") == "intel-6-207-amx"
    assert loop.cpu_kind(ZEN4, "avx512") == "amd-25-17-avx512"
    # The ISA that ran is part of the kind: a lowered ISA is another kind.
    assert loop.cpu_kind(ZEN4, "avx2") != loop.cpu_kind(ZEN4, "avx512")
    assert loop.cpu_kind().count("-") >= 3  # this machine's


def _mlp_with_references(tmp_path, kinds):
    """SUITE["mlp"] with its reference runs (mlp.json's curves) recorded on ``kinds``."""
    bench = SUITE["mlp"]
    recorded = bench.reference()
    (tmp_path / "mlp.json").write_text(json.dumps(recorded))
    for kind in kinds:
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "mlp.json").write_text(json.dumps({**recorded, "cpu_kind": kind}))
    return dataclasses.replace(bench, reference_dir=tmp_path)


def test_recorded_reference_only_for_its_cpu_kind(tmp_path):
    bench = _mlp_with_references(tmp_path, ["intel-6-207-amx"])
    assert bench.reference_for("intel-6-207-amx")["cpu_kind"] == "intel-6-207-amx"
    assert bench.reference_for("intel-6-167-amx") is None
    same = reference_result(bench, "brgemm", "closed", "float32", None, "intel-6-207-amx")
    assert same["same_cpu"] and same["result"] is not None
    assert "reference/intel-6-207-amx/mlp.json" in same["source"]
    other = reference_result(bench, "brgemm", "closed", "float32", None, "intel-6-167-amx")
    assert not other["same_cpu"] and other["cpu_kind"] is None


def test_sibling_runs_of_another_kind_do_not_normalize():
    sibling = {"benchmark": "mlp", "division": "closed", "dtype": "float32", "set": "runs/x/1",
               "cpu_model": "Intel(R) Xeon(R) Processor", "cpu_kind": "intel-6-167-amx",
               "score": {"value": 50.0, "valid": True}, "runs": []}
    ref = reference_result(SUITE["mlp"], "brgemm", "closed", "float32", sibling, "intel-6-207-amx")
    assert ref["result"] == 50.0 and not ref["same_cpu"]


def test_table_says_no_normalized_score():
    summary = {"benchmark": "mlp", "division": "closed", "impl": "brgemm", "dtype": "float32",
               "target": 0.9, "set": "s", "runs": [], "cpu_model": "Intel(R) Xeon(R) Processor",
               "cpu_kind": "intel-6-207-amx",
               "score": {"value": 40.0, "method": "olympic", "reason": ""},
               "rcp": {"status": "pass", "message": "ok"}, "normalized_score": None,
               "official": False}
    for ref in ({"result": 50.0, "source": "xla runs in s", "cpu_model": "Intel(R) Xeon(R) Processor",
                 "cpu_kind": "intel-6-167-amx", "same_cpu": False},
                {"result": None, "source": "none recorded", "cpu_model": None, "cpu_kind": None,
                 "same_cpu": False}):
        text = report.table({**summary, "reference": ref})
        assert "no normalized score" in text and "intel-6-207-amx" in text
        assert "->  normalized score" not in text
