"""What ``accelerate()`` keeps while it runs, the floor every other module of the package stands
on: this thread's contexts, the value of ``jax.make_user_context`` that JAX's tracing and
compilation caches key on (so a jitted function traced outside runs stock inside and the other
way round), what the interception tracks while it traces, and the report's records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax


@dataclasses.dataclass(frozen=True)
class Call:
    """One intercepted layer call: the module's path (an NNX module, which has none: its
    class and sizes) and class, and how it ran."""

    path: str
    layer: str
    accelerated: bool
    reason: str  # why it fell back to the stock module ("" when accelerated)
    # the stock recurrent scan (or cell call) this call is one time step of, "" if none:
    # such a layer runs on the kernels once per step, the recurrence itself stays stock
    step_of: str = ""
    # on the kernels with a precision other than float32: what it asked and what ran
    precision: str = ""

    def __str__(self):
        how = ("brgemm" + (f", {self.precision}" if self.precision else "") if self.accelerated
               else f"stock ({self.reason})")
        step = f", per step of {self.step_of}" if self.step_of else ""
        return f"{self.path or '<top>'} [{self.layer}]: {how}{step}"


@dataclasses.dataclass(frozen=True)
class Options:
    """What changes the traced program: part of the jit-cache key."""

    policy: bool


# None outside every context; the innermost context's Options inside (thread-local).
CACHE_KEY = jax.make_user_context(None)


class _State(threading.local):
    """This thread's contexts and what the interception tracks while it traces."""

    def __init__(self):
        self.contexts: list = []       # the Accelerate contexts entered (context.py)
        self.entered: list = []        # per context: the CACHE_KEY(...) and linen managers entered
        self.stock_scans: list[str] = []  # stock recurrent scans around the current call
        self.sublayers: dict = {}      # id(projection) -> (attention module, attribute)
        self.probing = 0               # > 0 while a scanned body runs abstractly


state = _State()


def options() -> Options | None:
    """This thread's innermost context's options, None outside every context (or while a
    scanned body is probed)."""
    return None if state.probing else CACHE_KEY.value


def record(path: str, layer: str, reason: str, precision: str = "") -> None:
    """Adds a call to the report of this thread's innermost context (once)."""
    call = Call(path, layer, not reason, reason, state.stock_scans[-1] if state.stock_scans else "",
                "" if reason else precision)
    calls = state.contexts[-1].calls
    if call not in calls:
        calls.append(call)


@contextlib.contextmanager
def stock_scan(layer: str, why: str):
    """Marks, in this thread, a stock recurrent scan that runs its cell step by step (``why``
    the fused kernels did not take it): layer calls inside are per-step work of that scan."""
    state.stock_scans.append(f"{layer}: {why}")
    try:
        yield
    finally:
        state.stock_scans.pop()


def in_stock_scan() -> bool:
    return bool(state.stock_scans)


@contextlib.contextmanager
def probing():
    """While a scanned body runs abstractly (``scans``), nothing is intercepted."""
    state.probing += 1
    try:
        yield
    finally:
        state.probing -= 1
