"""Fixtures shared by the tests.

Every test runs with accelerate()'s dispatch policy off (the tests check what the kernels
compute; on some CPUs the policy leaves float32 dense layers stock), except those marked
``policy``.

``tiny``: the train tests' tiny benchmark (tests/train/tiny_benchmark.py) in a directory
of the test module's own: its data, checker rules and an empty reference directory.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from jax_brgemm.accelerate import policy


@pytest.fixture(autouse=True)
def _every_layer_on_the_kernels(request, monkeypatch):
    if "policy" not in request.keywords:
        monkeypatch.setattr(policy, "TABLE", {})


def _tiny_benchmark():
    """tests/train/tiny_benchmark.py, the one module the train tests (which import it by
    name from their own directory) and their driver script share."""
    name = "tiny_benchmark"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parent / "train" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny_benchmark.Tiny: the ROOT (data, rules, reference runs) and its suite of
    ``tiny`` and ``tiny_never``. $JAX_BRGEMM_DATA is unset: the runs read ROOT's data."""
    tiny_benchmark = _tiny_benchmark()
    from jax_brgemm.train import data

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(data.ENV_VAR, raising=False)
        yield tiny_benchmark.prepare(tmp_path_factory.mktemp("tiny"))
