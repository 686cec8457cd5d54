"""``jax_brgemm.accelerate()``: run an unmodified Flax model's layers on the BRGEMM kernels.

Inside the context, every ``flax.linen.Dense``, ``flax.linen.Conv`` and LSTM ``flax.linen.RNN``
call, and every ``flax.nnx.Linear``, ``flax.nnx.Conv`` and LSTM ``flax.nnx.RNN`` call, that
the kernels support computes with the code of ``jax_brgemm.nn`` / ``jax_brgemm.nnx`` on
exactly the parameters the stock module created; everything else runs the stock module
unchanged. Parameter creation (linen's ``init``, NNX constructors) always runs the stock
code, so the parameter trees, and checkpoints, are the stock ones by construction::

    model = MyFlaxModel()                      # written against flax.linen only
    params = model.init(key, x)                # the same tree inside the context or not
    with jax_brgemm.accelerate():
        y = jax.jit(model.apply)(params, x)    # Dense layers traced here run on the kernels

The interception happens while JAX *traces*, in the thread that entered the context: a
function jitted and traced outside the context keeps its stock computation when it is called
inside it (and the other way round), and other threads are not affected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _validate as check
from jax_brgemm import nn as jbnn
from jax_brgemm.nn import _adapt
from jax_brgemm.nnx import _accelerate as nnx_rules


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

    def __str__(self):
        how = "brgemm" if self.accelerated else f"stock ({self.reason})"
        step = f", per step of {self.step_of}" if self.step_of else ""
        return f"{self.path or '<top>'} [{self.layer}]: {how}{step}"


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
        self._stack.enter_context(nnx_rules.intercept_calls(self._intercept_nnx))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        if self.report:
            print(self.summary())
            if not self.calls and exc[0] is None:
                warnings.warn(_NOTHING_SEEN, stacklevel=2)
        return False

    def summary(self) -> str:
        fast = sum(c.accelerated for c in self.calls)
        lines = [f"jax_brgemm.accelerate: {fast} of {len(self.calls)} layer calls on the kernels"]
        steps = sum(c.accelerated and bool(c.step_of) for c in self.calls)
        if steps:
            lines[0] += (f"; {steps} of them are layers inside stock recurrent scans, on the "
                         f"kernels once per time step (the recurrence itself runs stock)")
        return "\n".join(lines + [f"  {c}" for c in self.calls])

    def _add(self, call: Call):
        if call not in self.calls:
            self.calls.append(call)

    def _record(self, module, accelerated, reason=""):
        self._add(Call("/".join(module.scope.path) if module.scope else "",
                       type(module).__name__, accelerated, reason,
                       nnx_rules.enclosing_stock_scan() or ""))

    def _intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if module.scope is None or module.is_initializing():
            return next_fun(*args, **kwargs)  # parameters are created by the stock code
        if isinstance(module, nn.recurrent.RNNCellBase):
            return self._cell_steps(module, next_fun, args, kwargs, context.method_name)
        rule = _RULES.get(type(module))
        if rule is None or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        y, reason = rule(module, args, kwargs)
        self._record(module, y is not None, reason)
        if y is not None:
            return y
        if type(module) is nn.RNN:  # the stock scan: its cell's layers run per step
            with nnx_rules.stock_scan(_path(module) + f" [RNN over {type(module.cell).__name__}]",
                                      reason):
                return next_fun(*args, **kwargs)
        return next_fun(*args, **kwargs)

    def _cell_steps(self, cell, next_fun, args, kwargs, method):
        """A linen RNN cell called by something other than an intercepted ``nn.RNN`` (a
        ``nn.scan`` over the cell, as in Flax's sst2 example, or a loop): listed, with its
        layers as per-step work."""
        if (method != "__call__" or type(cell) not in _CELLS
                or nnx_rules.enclosing_stock_scan()):
            return next_fun(*args, **kwargs)
        name = type(cell).__name__
        why = f"{name} called step by step (nn.scan over the cell, or a loop)"
        self._record(cell, False, why + "; nn.RNN over OptimizedLSTMCell / LSTMCell is fused")
        with nnx_rules.stock_scan(f"{_path(cell)} [{name}]", why):
            return next_fun(*args, **kwargs)

    def _intercept_nnx(self, module, next_call, *args, **kwargs):
        rule = nnx_rules.RULES.get(type(module))
        if rule is not None:
            y, reason = rule(module, next_call, args, kwargs)
            self._add(Call(nnx_rules.describe(module), type(module).__name__, not reason,
                           reason, nnx_rules.enclosing_stock_scan() or ""))
            return y
        if type(module) in nnx_rules.CELLS and not nnx_rules.enclosing_stock_scan():
            why = f"{type(module).__name__} called step by step"
            self._add(Call(nnx_rules.describe(module), type(module).__name__, False,
                           why + "; nnx.RNN over OptimizedLSTMCell / LSTMCell is fused"))
            with nnx_rules.stock_scan(nnx_rules.describe(module), why):
                return next_call(*args, **kwargs)
        return next_call(*args, **kwargs)


_NOTHING_SEEN = (
    "jax_brgemm.accelerate(report=True) saw no layer call: nothing ran on the kernels. The "
    "likely cause: the model's function was jitted and traced before the context was entered "
    "(jax.jit / nnx.jit reuse that stock trace; trace it inside the context, or clear its "
    "cache), or it ran in another thread, or the model has no flax Dense / Linear, Conv or "
    "RNN layers.")


def _path(module) -> str:
    return ("/".join(module.scope.path) if module.scope else "") or "<top>"


def accelerate(report: bool = False) -> Accelerate:
    """Runs the supported stock Flax layers traced inside the context on the kernels.

    Covers ``flax.linen.Dense`` (any input rank; float32 or bfloat16 computation) and
    ``flax.linen.Conv`` (1-D and 2-D, every padding form, a negative pad cropping, strides,
    masks; float32 or bfloat16) and ``flax.linen.RNN`` over ``OptimizedLSTMCell`` or
    ``LSTMCell`` (the whole sequence as one fused ``jb.lstm`` call on the cell's parameters).
    A call falls back to the stock module, unchanged, for a custom ``dot_general`` /
    ``dot_general_cls`` / ``conv_general_dilated`` / ``promote_dtype``, a computation dtype
    other than float32 or bfloat16, or a subclass of the layer (e.g. ``ConvLocal``); a Conv
    also for input or kernel dilation, feature groups, a padding that crops the whole input
    or 3-D;
    an RNN also for other cells (or subclasses of these), gate / activation functions other
    than sigmoid / tanh, non-default scan settings (``variable_axes``,
    ``variable_broadcast``, ``variable_carry``), inputs without a batch dim, and
    ``seq_lengths`` with ``return_carry=True`` (each sequence's own last carry).

    NNX models are covered alike: ``flax.nnx.Linear``, ``flax.nnx.Conv`` and ``flax.nnx.RNN``
    over ``OptimizedLSTMCell`` / ``LSTMCell`` (what ``jax_brgemm.nnx`` runs on the kernels,
    see there), under ``jax.jit``, ``nnx.jit``, ``nnx.grad``, ``nnx.vmap`` and ``nnx.scan``.

    ``report=True`` prints, on exit, which calls ran on the kernels and why the others did
    not (also in ``.calls``; NNX layers, which have no path, by class and sizes); it warns
    when the context saw no layer call at all. A recurrent cell run step by step (``nn.scan``
    over a cell, a stock RNN fallback, a loop) is listed with its reason, and the layers
    inside it, which run on the kernels once per time step, say so.

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


_SIGMOIDS = {nn.sigmoid, jax.nn.sigmoid}
_TANHS = {nn.tanh, jnp.tanh, jax.nn.tanh} if hasattr(jax.nn, "tanh") else {nn.tanh, jnp.tanh}
_RNN_KWARGS = {"initial_carry", "init_key", "seq_lengths", "return_carry", "time_major",
               "reverse", "keep_order"}
# RNN's scan settings the fused call reproduces (the defaults: parameters broadcast over time).
_RNN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(nn.RNN)
                 if f.name in ("variable_axes", "variable_broadcast", "variable_carry")}


def _rnn(module: nn.RNN, args, kwargs):
    """RNN over OptimizedLSTMCell / LSTMCell: both cells create the same parameters and
    compute the same gates (i, f, g, o = sigmoid, sigmoid, tanh, sigmoid; c' = f c + i g,
    h' = o tanh c'), which the fused layer takes concatenated (``_adapt.lstm_params``)."""
    cell = module.cell
    if type(cell) not in (nn.OptimizedLSTMCell, nn.LSTMCell):
        return None, f"cell {type(cell).__name__}"
    if cell.gate_fn not in _SIGMOIDS or cell.activation_fn not in _TANHS:
        return None, "gate_fn / activation_fn other than sigmoid / tanh"
    for name, default in _RNN_DEFAULTS.items():
        if getattr(module, name) != default:
            return None, f"non-default {name}"
    if len(args) != 1 or set(kwargs) - _RNN_KWARGS:
        return None, "unexpected arguments"
    inputs = args[0]
    opt = {k: module.__getattribute__(k) if kwargs.get(k) is None else kwargs[k]
           for k in ("return_carry", "time_major", "reverse", "keep_order")}
    seq_lengths = kwargs.get("seq_lengths")
    if seq_lengths is not None and opt["return_carry"]:
        return None, "seq_lengths with return_carry (each sequence's own last carry)"
    if not hasattr(inputs, "ndim") or inputs.ndim < 3:
        return None, "inputs without a batch dim"
    # The cell's own scope: 'cell' under the RNN when the RNN adopted it (an RNN built
    # outside a module), or the cell's name in the enclosing module (built inside a compact
    # method, as in the Flax examples).
    try:
        params = cell.variables.get("params", {}) if cell.scope is not None else {}
    except Exception:  # an unbound cell  # noqa: BLE001
        params = {}
    fused, why = _adapt.lstm_params(params)
    if fused is None:
        return None, why
    kernel_i, kernel_h, bias = fused
    k = cell.features
    if kernel_h.shape != (k, 4 * k) or kernel_i.shape != (inputs.shape[-1], 4 * k):
        return None, "parameter shapes do not match the inputs"
    initial_carry = kwargs.get("initial_carry")
    if initial_carry is None:
        time_axis = 0 if opt["time_major"] else inputs.ndim - 2
        init_key = kwargs.get("init_key")
        initial_carry = cell.initialize_carry(
            jax.random.key(0) if init_key is None else init_key,
            inputs.shape[:time_axis] + inputs.shape[time_axis + 1:])
    try:
        c0, h0 = initial_carry
    except (TypeError, ValueError):
        return None, "initial_carry is not a pair (c, h)"
    # The stock computation's dtype: the cell's promote_dtype of the inputs, the carry and
    # the parameters (dtype=None) or the cell's dtype.
    dtype, why = _adapt.computation_dtype(cell.dtype, inputs, h0, kernel_i, kernel_h, bias)
    if dtype is None:
        return None, why
    if any(np.dtype(a.dtype) not in check.KERNEL_DTYPES for a in (kernel_i, kernel_h, bias)):
        return None, "parameters neither float32 nor bfloat16"
    return jbnn.lstm_on_kernels(inputs.astype(dtype), kernel_i, kernel_h, bias, (c0, h0),
                                dtype=dtype, seq_lengths=seq_lengths, **opt), ""


_RULES: dict[type, Callable[..., Any]] = {nn.Dense: _dense, nn.Conv: _conv, nn.RNN: _rnn}
_CELLS = (nn.OptimizedLSTMCell, nn.LSTMCell, nn.GRUCell, nn.SimpleCell, nn.MGUCell,
          nn.ConvLSTMCell)

__all__ = ["accelerate", "Accelerate", "Call"]
