"""Runs pytest on flax's own NNX layer tests with ``jax_brgemm.nnx``'s modules in place of
``flax.nnx``'s, and counts the tests whose layers computed on the kernels.

Run as a script in a subprocess (so the substitution stays there)::

    python tests/nnx/flax_substitute.py REPORT.json <pytest arguments>

``flax.nnx.Linear``, ``flax.nnx.Conv`` and ``flax.nnx.RNN`` are replaced by ``jb.nnx``'s
subclasses before the test files are collected, so every ``nnx.Linear(...)`` in them builds
a ``jb.nnx.Linear``. flax's own modules (the cells' gate layers, attention) import their
classes directly and stay stock. REPORT.json gets ``{test id: kernel calls}``.
"""

from __future__ import annotations

import collections
import json
import sys

import pytest

_KERNEL_CALLS = collections.Counter()
_current = []


def _counting(module, name):
    """Wraps ``module.name`` (returning ``(result or None, why)`` or the result) to count the
    calls that produced a result on the kernels."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = inner(*args, **kwargs)
        ran = out[0] is not None if isinstance(out, tuple) and len(out) == 2 and isinstance(
            out[1], str) else True
        if ran and _current:
            _KERNEL_CALLS[_current[-1]] += 1
        return out

    setattr(module, name, wrapper)


def pytest_configure(config):
    import flax.nnx

    import jax_brgemm.nn
    import jax_brgemm.nnx as jbnnx

    for name in ("Linear", "Conv", "RNN"):
        setattr(flax.nnx, name, getattr(jbnnx, name))
    # every layer call on the kernels goes through one of these (jb.nnx and accelerate()
    # call them as attributes of jax_brgemm.nn)
    for name in ("dense_on_kernels", "conv_on_kernels", "lstm_on_kernels"):
        _counting(jax_brgemm.nn, name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current.append(item.nodeid)
    _KERNEL_CALLS[item.nodeid] += 0
    try:
        yield
    finally:
        _current.pop()


def pytest_sessionfinish(session):
    with open(_REPORT, "w") as f:
        json.dump(dict(_KERNEL_CALLS), f, indent=1)


if __name__ == "__main__":
    _REPORT = sys.argv[1]
    sys.exit(pytest.main(sys.argv[2:], plugins=[sys.modules[__name__]]))
