"""Where ``accelerate()`` reaches into flax, and for how long.

linen's layers are intercepted with flax's own ``nn.intercept_methods`` (per thread, for as
long as the thread is inside a context). Four things have no such hook: the ``__call__`` (and
``Embed.attend``) of NNX layers (plain Python objects), the methods ``nn.scan`` made (flax
marks them as already wrapped, so ``intercept_methods`` never sees the scan as one call),
classes defined while a context is open, and two functions: ``jax.nn.gelu`` (found by models
as ``jax.nn.gelu``, ``flax.linen.gelu`` or ``flax.nnx.gelu``) and ``jax.random.bernoulli``
(dropout's masks, found by flax's ``Dropout`` as ``jax.random.bernoulli``). These are replaced when the first context of the process is entered and
put back, the same objects, when the last one exits; the replacements run flax's own code
unless the calling thread is inside a context.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import flax.linen as nn
import jax
from flax import nnx

from jax_brgemm.accelerate import dispatch, scans
from jax_brgemm.accelerate.state import options

_lock = threading.RLock()  # a class defined while installing re-enters through the hook
_users = 0  # contexts open in any thread
_MISSING = object()
_saved: list[tuple[type, str, object]] = []  # (owner, name, its own attribute before)


def acquire() -> None:
    """One more open context; the first installs the replacements."""
    global _users
    with _lock:
        if _users == 0:
            _install()
        _users += 1


def release() -> None:
    """One context fewer; the last puts every replaced attribute back."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            while _saved:
                owner, name, before = _saved.pop()
                if before is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, before)


def linen_interception():
    """linen's interceptor for this thread (``nn.intercept_methods``, a context manager)."""
    return nn.intercept_methods(dispatch.linen_call)


def _replace(owner: type, name: str, value) -> None:
    _saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, value)


def _install() -> None:
    for cls in dispatch.NNX_CLASSES:
        if "__call__" in cls.__dict__:
            _replace(cls, "__call__", _nnx_router(cls.__dict__["__call__"], dispatch.nnx_call))
    for cls, method in dispatch.NNX_METHOD_RULES:
        _replace(cls, method, _nnx_router(cls.__dict__[method], dispatch.nnx_method_call(method)))
    routed = dispatch.gelu_call(jax.nn.gelu)
    for owner in (jax.nn, nn, nn.activation, nnx):  # where models find jax's gelu
        if getattr(owner, "gelu", None) is routed.__wrapped__:
            _replace(owner, "gelu", routed)
    _replace(jax.random, "bernoulli", dispatch.bernoulli_call(jax.random.bernoulli))  # dropout's masks
    pending, seen = [nn.Module], set()
    while pending:
        cls = pending.pop()
        if cls not in seen:
            seen.add(cls)
            _route_scans(cls, dispatch.scan_call)
            pending.extend(cls.__subclasses__())
    flax_hook = nn.Module.__dict__["__init_subclass__"]

    def __init_subclass__(cls, **kwargs):  # a class defined while a context is open
        flax_hook.__get__(None, cls)(**kwargs)
        with _lock:
            if _users:
                _route_scans(cls, dispatch.scan_call)

    _replace(nn.Module, "__init_subclass__", classmethod(__init_subclass__))


def _nnx_router(stock_call, handle):
    @functools.wraps(stock_call)
    def __call__(self, *args, **kwargs):
        if options() is None:
            return stock_call(self, *args, **kwargs)
        return handle(self, functools.partial(stock_call, self), args, kwargs)

    return __call__


def _route_scans(cls: type, handle) -> None:
    """Replaces each method of ``cls``'s own that ``nn.scan`` made by one that hands the call
    to ``handle(module, scan, next_call, args, kwargs)`` inside a context."""
    for name, method in list(cls.__dict__.items()):
        scan = scans.lifted_scan(method)
        if scan is None:
            continue
        scan = dataclasses.replace(scan, name=name)

        def routed(self, *args, _flax_call=method, _scan=scan, **kwargs):
            if options() is None:
                return _flax_call(self, *args, **kwargs)
            return handle(self, _scan, functools.partial(_flax_call, self), args, kwargs)

        _replace(cls, name, functools.wraps(method)(routed))  # keeps flax's wrapped mark
