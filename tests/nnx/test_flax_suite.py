"""flax's own layer tests, of the installed flax and from its source distribution, pass with
jax_brgemm in the way, and a good part of them compute on the kernels:

* ``substitute``: flax's NNX layer tests (``tests/nnx/nn/linear_test.py``, ``conv_test.py``,
  ``recurrent_test.py``) with ``jax_brgemm.nnx``'s ``Linear`` / ``Conv`` / ``ConvTranspose``
  / ``RNN`` in place of flax's;
* ``accelerate``: those and flax's ``linen_linear_test.py`` / ``linen_recurrent_test.py`` /
  ``linen_attention_test.py``,
  each test inside ``jax_brgemm.accelerate()``, linen's ``init_with_output`` followed by
  ``apply`` (where the kernels run).

Each file runs in its own pytest subprocess under flax's own pytest configuration (which
turns every warning into an error); ``flax_suite_runner.py`` makes the change and counts, per
test, the layer calls that ran on the kernels.
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

# (mode, flax test file) -> the fewest of its tests that must compute on the kernels.
# conv_test's cases (feature groups, kernel and input dilations, ConvTranspose) all do;
# recurrent_test's GRU and float16 cases run stock.
CASES = {
    ("substitute", "nnx/nn/linear_test.py"): 24,
    ("substitute", "nnx/nn/conv_test.py"): 112,
    ("substitute", "nnx/nn/recurrent_test.py"): 8,
    ("accelerate", "nnx/nn/linear_test.py"): 24,
    ("accelerate", "nnx/nn/conv_test.py"): 112,
    ("accelerate", "nnx/nn/recurrent_test.py"): 16,
    ("accelerate", "linen/linen_linear_test.py"): 400,
    ("accelerate", "linen/linen_recurrent_test.py"): 15,
    ("accelerate", "linen/linen_attention_test.py"): 16,
}


@pytest.fixture(scope="module")
def flax_tree():
    return flax_source_tree()


@pytest.mark.slow  # a pytest subprocess per file, ~15-90 s each
@pytest.mark.parametrize("mode,name", sorted(CASES), ids=[f"{m}-{n}" for m, n in sorted(CASES)])
def test_flax_layer_tests_pass_on_the_kernels(mode, name, flax_tree, tmp_path, record_property):
    test_file = flax_tree / "tests" / name
    assert test_file.is_file(), f"flax's source distribution has no {test_file}"
    report = tmp_path / "kernel_calls.json"
    # run from an empty directory: the source tree's flax/ must not shadow the installed one
    cmd = [sys.executable, str(HERE / "flax_suite_runner.py"), mode, str(report), "-q",
           "-p", "no:cacheprovider", "-c", str(flax_tree / "pyproject.toml"),
           "--rootdir", str(flax_tree), str(test_file)]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=3600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"flax's {name} failed ({mode}):\n{log[-6000:]}"
    passed = int(re.search(r"(\d+) passed", log).group(1))
    calls = json.loads(report.read_text())
    on_kernels = sum(1 for n in calls.values() if n > 0)
    record_property("flax_tests_passed", passed)
    record_property("flax_tests_on_kernels", on_kernels)
    print(f"flax {name} ({mode}): {passed} passed, {on_kernels} of them on the kernels")
    assert len(calls) == passed
    assert on_kernels >= CASES[mode, name], (
        f"only {on_kernels} of flax's {name} tests ran on the kernels ({mode}):\n"
        + "\n".join(f"  {k}: {v}" for k, v in calls.items()))
