"""``jax_brgemm.accelerate()``: run an unmodified Flax model's layers on the BRGEMM kernels.

Inside the context, every ``flax.linen.Dense`` and ``flax.linen.Conv`` call that the kernels
support computes with ``jb.dense`` / ``jb.conv2d`` on exactly the parameters the stock module created; everything else runs the
stock module unchanged. Parameter creation (``init``) always runs the stock code, so the
parameter trees, and checkpoints, are the stock ones by construction::

    model = MyFlaxModel()                      # written against flax.linen only
    params = model.init(key, x)                # the same tree inside the context or not
    with jax_brgemm.accelerate():
        y = jax.jit(model.apply)(params, x)    # Dense layers traced here run on the kernels

The interception happens while JAX *traces*: a function jitted and traced outside the
context keeps its stock computation when it is called inside it (and the other way round).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from jax_brgemm import nn as jbnn


@dataclasses.dataclass(frozen=True)
class Call:
    """One intercepted layer call: the module's path and class, and how it ran."""

    path: str
    layer: str
    accelerated: bool
    reason: str  # why it fell back to the stock module ("" when accelerated)

    def __str__(self):
        how = "brgemm" if self.accelerated else f"stock ({self.reason})"
        return f"{self.path or '<top>'} [{self.layer}]: {how}"


class Accelerate(contextlib.ContextDecorator):
    """The context manager (and decorator) that ``accelerate()`` returns.

    Attributes:
      calls: every distinct layer call traced inside the context, in order.
      report: print ``calls`` when the context exits.
    """

    def __init__(self, report: bool = False):
        self.report = report
        self.calls: list[Call] = []
        self._stack = None

    def __enter__(self):
        self.calls = []
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(nn.intercept_methods(self._intercept))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        if self.report:
            print(self.summary())
        return False

    def summary(self) -> str:
        fast = sum(c.accelerated for c in self.calls)
        lines = [f"jax_brgemm.accelerate: {fast} of {len(self.calls)} layer calls on the kernels"]
        return "\n".join(lines + [f"  {c}" for c in self.calls])

    def _record(self, module, accelerated, reason=""):
        call = Call("/".join(module.scope.path) if module.scope else "", type(module).__name__,
                    accelerated, reason)
        if call not in self.calls:
            self.calls.append(call)

    def _intercept(self, next_fun, args, kwargs, context):
        module = context.module
        rule = _RULES.get(type(module))
        if rule is None or context.method_name != "__call__" or module.scope is None:
            return next_fun(*args, **kwargs)
        if module.is_initializing():  # parameters are created by the stock code
            return next_fun(*args, **kwargs)
        y, reason = rule(module, args, kwargs)
        self._record(module, y is not None, reason)
        return next_fun(*args, **kwargs) if y is None else y


def accelerate(report: bool = False) -> Accelerate:
    """Runs the supported stock Flax layers traced inside the context on the kernels.

    Covers ``flax.linen.Dense`` (any input rank; float32 or bfloat16 computation) and
    ``flax.linen.Conv`` (1-D and 2-D, every padding form with non-negative pads, strides,
    masks; float32 or bfloat16). A call falls back to the stock module, unchanged, for a
    custom ``dot_general`` / ``dot_general_cls`` / ``conv_general_dilated`` /
    ``promote_dtype``, a computation dtype other than float32 or bfloat16, input or kernel
    dilation, feature groups, negative (cropping) padding, a 3-D convolution, or a subclass
    of the layer (e.g. ``ConvLocal``). ``report=True`` prints, on exit, which calls ran
    on the kernels and why the others did not (also in ``.calls``).

    Usable as ``with jax_brgemm.accelerate(): ...`` or as a decorator.
    """
    return Accelerate(report)


# --- the layers: each rule returns (the result on the kernels, "") or (None, why not) ------


def _dense(module: nn.Dense, args, kwargs):
    params = module.variables.get("params", {})
    if len(args) != 1 or kwargs or jnp.ndim(args[0]) < 1:
        return None, "unexpected arguments"
    if "kernel" not in params or (module.use_bias and "bias" not in params):
        return None, "parameters not created yet"
    return jbnn.dense_on_kernels(module, args[0], params["kernel"], params.get("bias"))


def _conv(module: nn.Conv, args, kwargs):
    params = module.variables.get("params", {})
    if len(args) != 1 or kwargs:
        return None, "unexpected arguments"
    if "kernel" not in params or (module.use_bias and "bias" not in params):
        return None, "parameters not created yet"
    return jbnn.conv_on_kernels(module, args[0], params["kernel"], params.get("bias"))


_RULES: dict[type, Callable[..., Any]] = {nn.Dense: _dense, nn.Conv: _conv}

__all__ = ["accelerate", "Accelerate", "Call"]
