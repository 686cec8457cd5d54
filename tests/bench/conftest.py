"""The bench scripts as modules: imported from bench/ with their results written to a
temporary folder and jax_brgemm.precision.EMULATE (which their main() sets) restored."""

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch, tmp_path):
    """bench(name) -> the module bench/<name>.py; its results files land in tmp_path."""
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their neighbour common
    monkeypatch.setattr(importlib.import_module("common"), "RESULTS", tmp_path)
    from jax_brgemm import precision
    monkeypatch.setattr(precision, "EMULATE", precision.EMULATE)
    return importlib.import_module
