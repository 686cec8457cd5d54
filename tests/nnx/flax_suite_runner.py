"""Runs pytest on flax's own layer tests with jax_brgemm in the way, and counts the tests
whose layers computed on the kernels.

Run as a script in a subprocess (so that what it changes stays there)::

    python tests/nnx/flax_suite_runner.py MODE REPORT.json <pytest arguments>

MODE ``substitute``: ``flax.nnx.Linear``, ``Conv``, ``ConvTranspose`` and ``RNN`` are replaced
by ``jb.nnx``'s subclasses before the test files are collected, so every ``nnx.Linear(...)``
in them builds a ``jb.nnx.Linear``; flax's own modules (the cells' gate layers, attention)
import their classes directly and stay stock.

MODE ``accelerate``: every test runs inside ``jb.accelerate()``. linen's
``init_with_output``, which flax's linen tests call where users would call ``apply``, and
which always runs stock code, is followed by ``apply`` of the variables it created (in the
context), whose output it returns: the tests then check the kernels' results.

REPORT.json gets ``{test id: layer calls on the kernels}``.
"""

from __future__ import annotations

import collections
import functools
import json
import sys

import jax
import pytest

_KERNEL_CALLS = collections.Counter()
_current = []
_MODE = "substitute"
_REPORT = None


def _counting_kernel_calls():
    """Wraps ``jax.ffi.ffi_call`` (through which every op of jax_brgemm calls a kernel) to
    count the kernel calls each test traces."""
    inner = jax.ffi.ffi_call

    def ffi_call(target_name, *args, **kwargs):
        if str(target_name).startswith("jb_") and _current:
            _KERNEL_CALLS[_current[-1]] += 1
        return inner(target_name, *args, **kwargs)

    jax.ffi.ffi_call = ffi_call


def _then_apply(init_with_output):
    """linen's ``init_with_output`` returning the output of ``apply`` on the new variables."""

    @functools.wraps(init_with_output)
    def wrapper(self, rngs, *args, method=None, capture_intermediates=False, **kwargs):
        y, variables = init_with_output(self, rngs, *args, method=method,
                                        capture_intermediates=capture_intermediates, **kwargs)
        if capture_intermediates or not _current:
            return y, variables
        kwargs.pop("mutable", None)
        try:
            y, _ = self.apply(variables, *args, rngs=rngs if isinstance(rngs, dict) else
                              {"params": rngs}, method=method, mutable=True, **kwargs)
        except Exception:  # noqa: BLE001  (apply cannot replay this init: keep its output)
            pass
        return y, variables

    return wrapper


def pytest_configure(config):
    import flax.linen
    import flax.nnx

    import jax_brgemm.nn
    import jax_brgemm.nnx as jbnnx

    if _MODE == "substitute":
        for name in ("Linear", "Conv", "ConvTranspose", "RNN"):
            setattr(flax.nnx, name, getattr(jbnnx, name))
    else:
        flax.linen.Module.init_with_output = _then_apply(flax.linen.Module.init_with_output)
    _counting_kernel_calls()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    import jax_brgemm

    _current.append(item.nodeid)
    _KERNEL_CALLS[item.nodeid] += 0
    try:
        if _MODE == "accelerate":
            with jax_brgemm.accelerate(policy=False):  # flax's tests of the kernels
                yield
        else:
            yield
    finally:
        _current.pop()


def pytest_sessionfinish(session):
    with open(_REPORT, "w") as f:
        json.dump(dict(_KERNEL_CALLS), f, indent=1)


if __name__ == "__main__":
    _MODE, _REPORT = sys.argv[1], sys.argv[2]
    if _MODE not in ("substitute", "accelerate"):
        raise SystemExit(f"MODE must be substitute or accelerate, got {_MODE!r}")
    sys.exit(pytest.main(sys.argv[3:], plugins=[sys.modules[__name__]]))
