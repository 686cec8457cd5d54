"""Call interception for stock ``flax.nnx`` layers, as ``flax.linen.intercept_methods`` is for
linen modules: what lets ``accelerate()`` run unmodified NNX models on the kernels. It also
serves the linen classes ``nn.scan`` makes, whose calls bypass ``intercept_methods``.

NNX modules are plain Python objects with no interception hook, so the ``__call__`` of each
intercepted class is wrapped once, for good; the wrapper looks at a thread-local stack of
interceptors, so a context entered in one thread changes nothing in another, and an empty
stack costs one attribute lookup.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Iterable

#: ``interceptor(module, next_call, *args, **kwargs)``: the result of ``module(*args,
#: **kwargs)``; ``next_call(*args, **kwargs)`` runs the next interceptor or the stock call.
Interceptor = Callable[..., Any]

_state = threading.local()
_lock = threading.Lock()
# weak keys: linen's nn.scan makes a new class each time a model is traced
_wrapped: weakref.WeakKeyDictionary[type, Callable] = weakref.WeakKeyDictionary()


def _stack() -> list[Interceptor]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def wrap(cls: type) -> None:
    """Routes ``cls``'s calls through the interceptors of ``intercept_calls`` contexts."""
    with _lock:
        if cls in _wrapped:
            return
        stock_call = cls.__call__

        @functools.wraps(stock_call)
        def __call__(self, *args, **kwargs):
            stack = getattr(_state, "stack", None)
            if not stack:
                return stock_call(self, *args, **kwargs)
            call = functools.partial(stock_call, self)
            for interceptor in stack:  # the innermost context's runs first
                call = functools.partial(interceptor, self, call)
            return call(*args, **kwargs)

        _wrapped[cls] = stock_call
        cls.__call__ = __call__


def stock_call(cls: type) -> Callable:
    """``cls.__call__`` as flax defines it (unwrapped)."""
    return _wrapped.get(cls, cls.__call__)


@contextlib.contextmanager
def intercept_calls(interceptor: Interceptor, classes: Iterable[type]):
    """Within the context, in this thread, every call of an instance of ``classes`` (or of a
    subclass that keeps their ``__call__``) goes through ``interceptor``."""
    for cls in classes:
        wrap(cls)
    stack = _stack()
    stack.append(interceptor)
    try:
        yield
    finally:
        assert stack.pop() is interceptor


@contextlib.contextmanager
def stock_scan(layer: str, why: str):
    """Marks, in this thread, a stock recurrent scan that runs its cell step by step (``why``
    the fused kernels did not take it): layer calls inside are per-step work of that scan."""
    scans = getattr(_state, "scans", None)
    if scans is None:
        scans = _state.scans = []
    scans.append(f"{layer}: {why}")
    try:
        yield
    finally:
        scans.pop()


def enclosing_stock_scan() -> str | None:
    """The innermost stock scan around the current call (see ``stock_scan``), or None."""
    scans = getattr(_state, "scans", None)
    return scans[-1] if scans else None
