"""Fixtures shared by the tests.

Every test runs with accelerate()'s dispatch policy off (the tests check what the kernels
compute; on some CPUs the policy leaves float32 dense layers stock), except those marked
``policy``.

Every test runs with ``JAX_BRGEMM_EMULATE=0`` (exact float32 products whatever the precision
asked), so that what a test computes does not depend on whether the CPU has AMX, unless it
sets ``precision.EMULATE`` itself; tests/ops/test_precision.py checks the default, which
follows the CPU, in processes of their own.

The quick tier (``-m "not slow"``, the README's and CI's run) takes one case in four of a
parametrized test with four or more, one in two of one with two or three, starting at a
case its name picks (so that not every test keeps its first dtype); the full run takes
every case. The tests compile far more than they run: all share one persistent compilation
cache that starts empty each run (the same stock references and kernels compile once for the
run's workers rather than once per test), and XLA's LLVM passes run at level 0
(``--xla_backend_optimization_level=0`` unless ``XLA_FLAGS`` sets a level; without
fast-math either way, the numerics are the same): the quick tier 882 -> 639 s on Zen 3.

``tiny``: the train tests' tiny benchmark (tests/train/tiny_benchmark.py) in a directory
of the test module's own: its data, checker rules and an empty reference directory.
"""

import importlib.util
import os
import shutil
import sys
import tempfile
import zlib
from collections import defaultdict
from pathlib import Path

import jax
import pytest

os.environ.setdefault("JAX_BRGEMM_EMULATE", "0")  # read when jax_brgemm is imported, below

from jax_brgemm.accelerate import policy  # noqa: E402


_CACHE_ENV = "JAX_BRGEMM_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
    # The controller (or a lone process) makes the directory; xdist workers, started after,
    # inherit its name.
    if _CACHE_ENV not in os.environ:
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jax_brgemm-tests-")
        config._jb_cache_owner = True
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
    if getattr(config, "_jb_cache_owner", False):
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    cases = defaultdict(list)
    for item in items:
        if hasattr(item, "callspec"):
            cases[(item.path, item.cls, item.originalname)].append(item)
    for (path, _, name), group in cases.items():
        if len(group) < 2:
            continue
        every = 4 if len(group) >= 4 else 2
        first = zlib.crc32(f"{path.name}::{name}".encode()) % every  # not always the first dtype
        for i, item in enumerate(group):
            if i % every != first:
                item.add_marker(pytest.mark.slow)


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
