"""flax's own NNX layer tests (``tests/nnx/nn/linear_test.py``, ``conv_test.py``,
``recurrent_test.py`` of the installed flax, from its source distribution) pass with
``jax_brgemm.nnx``'s ``Linear`` / ``Conv`` / ``RNN`` in place of flax's, and some of them
compute on the kernels.

Each file runs in its own pytest subprocess under flax's own pytest configuration (which
turns every warning into an error); ``flax_substitute.py`` swaps the classes in and counts,
per test, the layer calls that ran on the kernels.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flax_sources import flax_source_tree

HERE = Path(__file__).resolve().parent

# flax test file -> the fewest of its tests that must compute on the kernels: conv_test's
# every case uses feature groups and dilations, which run stock (so it checks the fallback).
FILES = {"linear_test.py": 24, "conv_test.py": 0, "recurrent_test.py": 8}


@pytest.fixture(scope="module")
def flax_tree():
    return flax_source_tree()


@pytest.mark.slow  # a pytest subprocess per file, ~15-50 s each
@pytest.mark.parametrize("name", sorted(FILES))
def test_flax_nnx_layer_tests_pass_with_jb_nnx(name, flax_tree, tmp_path, record_property):
    test_file = flax_tree / "tests" / "nnx" / "nn" / name
    assert test_file.is_file(), f"flax's source distribution has no {test_file}"
    report = tmp_path / "kernel_calls.json"
    # run from an empty directory: the source tree's flax/ must not shadow the installed one
    cmd = [sys.executable, str(HERE / "flax_substitute.py"), str(report), "-q",
           "-p", "no:cacheprovider", "-c", str(flax_tree / "pyproject.toml"),
           "--rootdir", str(flax_tree), str(test_file)]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"flax's {name} failed with jb.nnx substituted:\n{log[-6000:]}"
    passed = int(re.search(r"(\d+) passed", log).group(1))
    calls = json.loads(report.read_text())
    on_kernels = sum(1 for n in calls.values() if n > 0)
    record_property("flax_tests_passed", passed)
    record_property("flax_tests_on_kernels", on_kernels)
    print(f"flax {name}: {passed} passed, {on_kernels} of them on the kernels")
    assert len(calls) == passed
    assert on_kernels >= FILES[name], (
        f"only {on_kernels} of flax's {name} tests ran on the kernels:\n"
        + "\n".join(f"  {k}: {v}" for k, v in calls.items()))
