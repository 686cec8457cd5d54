"""``jax_brgemm.accelerate()``: run an unmodified Flax model's layers on the BRGEMM kernels.

Inside the context, every call of a Flax layer the kernels support (linen's Dense, Conv,
LSTM RNN and scans, attention, DenseGeneral and Einsum; their NNX twins) computes with the
code of ``jax_brgemm.nn`` / ``jax_brgemm.nnx`` on exactly the parameters the stock module
created; everything else runs the stock module unchanged. Parameter creation (linen's
``init``, NNX constructors) always runs the stock code, so the parameter trees, and
checkpoints, are the stock ones by construction::

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
import threading
import warnings
import weakref
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import lift

from jax_brgemm import _validate as check
from jax_brgemm import nn as jbnn
from jax_brgemm import policy as dispatch_policy
from jax_brgemm.nn import _adapt, scan_methods
from jax_brgemm.nnx import _accelerate as nnx_rules
from jax_brgemm.nnx import _intercept
from jax_brgemm.nnx import attention as nnx_attention


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
      policy: leave the calls ``jax_brgemm.policy`` names to stock XLA.
    """

    def __init__(self, report: bool = False, policy: bool = True):
        self.report = report
        self.policy = policy
        self.calls: list[Call] = []
        self._stack = None

    def __enter__(self):
        self.calls = []
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(dispatch_policy.applied(self.policy))
        self._stack.enter_context(nn.intercept_methods(self._intercept))
        _watch_scans()
        scan_methods.watch()
        self._stack.enter_context(scan_methods.handle_calls(self._scanned_method))
        self._stack.enter_context(nnx_rules.intercept_calls(self._intercept_call))
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

    def _record(self, module, accelerated, reason="", layer=""):
        self._add(Call("/".join(module.scope.path) if module.scope else "",
                       layer or type(module).__name__, accelerated, reason,
                       nnx_rules.enclosing_stock_scan() or ""))

    def _intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if module.scope is None or module.is_initializing() or scan_methods.probing():
            return next_fun(*args, **kwargs)  # parameters are created by the stock code
        if isinstance(module, nn.recurrent.RNNCellBase):
            return self._cell_steps(module, next_fun, args, kwargs, context.method_name)
        if type(module) in jbnn.ATTENTION_MODULES and context.method_name == "__call__":
            return self._attention(module, next_fun, args, kwargs)
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
        """A linen RNN cell called by something other than an intercepted ``nn.RNN`` or
        ``nn.scan`` (a loop, another transform): listed, with its layers as per-step work."""
        if (method != "__call__" or type(cell) not in _CELLS
                or nnx_rules.enclosing_stock_scan()):
            return next_fun(*args, **kwargs)
        name = type(cell).__name__
        why = f"{name} called step by step (a loop, or a transform other than nn.scan)"
        self._record(cell, False, why + "; nn.RNN and nn.scan over OptimizedLSTMCell / "
                                        "LSTMCell, or over a method calling one, are fused")
        with nnx_rules.stock_scan(f"{_path(cell)} [{name}]", why):
            return next_fun(*args, **kwargs)

    def _scanned_cell(self, module, settings, next_call, args, kwargs):
        """A call of a class ``nn.scan(OptimizedLSTMCell or LSTMCell, ...)`` made: the whole
        scan as one fused call when its settings are the plain ones, else stock, listed."""
        if module.scope is None or module.is_initializing():
            return next_call(*args, **kwargs)  # parameters are created by the stock code
        y, reason = _scan_over_lstm(module, *settings, args, kwargs)
        return self._fused_or_stock(module, f"nn.scan({settings[0].__name__})", y, reason,
                                    next_call, args, kwargs)

    def _scanned_method(self, module, method, body, scan, next_call, *args, **kwargs):
        """A call of a module method ``nn.scan`` decorated (Flax's sst2 SimpleLSTM): one
        fused call when its body is one LSTM cell step (``scan_methods.lstm_step``)."""
        if module.scope is None or module.is_initializing():
            return next_call(*args, **kwargs)  # parameters are created by the stock code
        cell, params, reason = scan_methods.lstm_step(module, body, scan, args, kwargs)
        y = None
        if cell is not None:
            y, reason = _scan_over_lstm(cell, type(cell), scan, args, kwargs, params)
        return self._fused_or_stock(module, f"nn.scan({type(module).__name__}.{method})", y,
                                    reason, next_call, args, kwargs)

    def _fused_or_stock(self, module, layer, y, reason, next_call, args, kwargs):
        """Records a scan's call; runs the stock scan, marked as such, when not fused."""
        self._record(module, y is not None, reason, layer)
        if y is not None:
            return y
        with nnx_rules.stock_scan(f"{_path(module)} [{layer}]", reason):
            return next_call(*args, **kwargs)

    def _attention(self, module, next_fun, args, kwargs):
        """MultiHeadDotProductAttention: its projections are DenseGeneral calls (their own
        rule); its attention runs on the kernels by handing the module, for this call, an
        ``attention_fn`` with Flax's default's signature that computes on them (or, where
        they do not take the call, runs Flax's default and says why)."""
        if getattr(module.attention_fn, "_jb_accelerate", False):  # SelfAttention's super() call
            return next_fun(*args, **kwargs)
        why = jbnn.attention_module_reason(module, kwargs)
        if why:
            self._record(module, False, why)
            return next_fun(*args, **kwargs)

        def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                         dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                         force_fp32_for_softmax=False, einsum_dot_general=None, qk_attn_weights_einsum=None,
                         attn_weights_value_einsum=None):
            call = dict(bias=bias, mask=mask, broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
                        dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype, precision=precision,
                        module=module, force_fp32_for_softmax=force_fp32_for_softmax,
                        einsum_dot_general=einsum_dot_general, qk_attn_weights_einsum=qk_attn_weights_einsum,
                        attn_weights_value_einsum=attn_weights_value_einsum)
            y, reason = jbnn.attention_on_kernels(query, key, value, **call)
            self._record(layer, y is not None, reason)
            return nn.dot_product_attention(query, key, value, **call) if y is None else y

        layer = module
        attention_fn._jb_accelerate = True
        # The module is a frozen dataclass; its field is swapped for the call and restored.
        object.__setattr__(module, "attention_fn", attention_fn)
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "attention_fn", nn.dot_product_attention)

    def _intercept_call(self, module, next_call, *args, **kwargs):
        if scan_methods.probing():
            return next_call(*args, **kwargs)
        settings = _SCANS.get(type(module))
        if settings is not None:
            return self._scanned_cell(module, settings, next_call, args, kwargs)
        rule = nnx_rules.RULES.get(type(module))
        if rule is not None:
            y, reason = rule(module, next_call, args, kwargs)
            if reason is not None:  # None: an enclosing context's interceptor records it
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


def accelerate(report: bool = False, policy: bool = True) -> Accelerate:
    """Runs the supported stock Flax layers traced inside the context on the kernels.

    Covers ``flax.linen.Dense`` (any input rank; float32 or bfloat16 computation),
    ``flax.linen.DenseGeneral`` over the input's trailing axes (without ``batch_dims``),
    ``flax.linen.Einsum`` whose equation is a matrix product (``"...d,dnh->...nh"``),
    ``flax.linen.MultiHeadDotProductAttention`` (its attention on ``jb.dot_product_attention``
    with a float32 softmax, its projections as DenseGeneral; stock for a custom
    ``attention_fn`` or einsums, ``decode``, attention dropout and ``sow_weights``), and
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
    ``seq_lengths`` with ``return_carry=True`` over more than one batch dim.
    ``nn.scan(OptimizedLSTMCell or LSTMCell, variable_broadcast="params", ...)`` (Flax's
    sst2 pattern), called on ``(carry, inputs)``, runs fused too, for ``reverse`` either way
    and the time axis 0 or 1 of 3-D inputs and outputs (``in_axes`` / ``out_axes``); stock,
    listed with the reason, for per-step or carried parameters, a ``data_transform``, other
    axes or shapes. So does ``nn.scan`` over a module method whose body only calls one such
    cell on its own ``(carry, x)`` and returns the cell's result (the sst2 example's
    ``SimpleLSTM``); a body that does anything more stays stock, listed with the reason.

    NNX models are covered alike: ``flax.nnx.Linear``, ``flax.nnx.Conv`` and ``flax.nnx.RNN``
    over ``OptimizedLSTMCell`` / ``LSTMCell`` (what ``jax_brgemm.nnx`` runs on the kernels,
    see there), ``flax.nnx.MultiHeadAttention`` as linen's (``num_kv_heads`` and
    ``is_causal`` too), ``LinearGeneral`` (without ``batch_axis``) and ``Einsum`` as linen's
    DenseGeneral and Einsum, under ``jax.jit``, ``nnx.jit``, ``nnx.grad``, ``nnx.vmap`` and
    ``nnx.scan``.

    Where the kernels take a call but lose to stock XLA on this CPU, the call stays stock,
    with the reason in the report: ``jax_brgemm.policy.TABLE``, fixed at import from the
    CPU's ISA (float32 Dense-like layers over fewer than 512 rows, whose dots XLA overlaps
    with the optimizer step; larger or bfloat16 ones, convolutions, LSTMs and attention run
    on the kernels). ``policy=False`` runs every call the kernels take on them.

    ``report=True`` prints, on exit, which calls ran on the kernels and why the others did
    not (also in ``.calls``; NNX layers, which have no path, by class and sizes); it warns
    when the context saw no layer call at all. A recurrent cell run step by step (a stock
    ``nn.scan`` over a cell or a method, a stock RNN fallback, a loop) is listed with its
    reason, and the layers inside it, which run on the kernels once per time step, say so.

    Usable as ``with jax_brgemm.accelerate(): ...`` or as a decorator.
    """
    return Accelerate(report, policy)


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


def _lstm_cell_why(cell, cell_class: type) -> str:
    """Why the fused layer does not compute what this cell (of class ``cell_class``, or made
    by nn.scan over it) does ("" when it does)."""
    if cell_class not in _LSTM_CELLS:
        return f"cell {cell_class.__name__}"
    if cell.gate_fn not in _SIGMOIDS or cell.activation_fn not in _TANHS:
        return "gate_fn / activation_fn other than sigmoid / tanh"
    return ""


def _rnn(module: nn.RNN, args, kwargs):
    """RNN over OptimizedLSTMCell / LSTMCell: both cells create the same parameters and
    compute the same gates (i, f, g, o = sigmoid, sigmoid, tanh, sigmoid; c' = f c + i g,
    h' = o tanh c'), which the fused layer takes concatenated (``_adapt.lstm_params``)."""
    cell = module.cell
    why = _lstm_cell_why(cell, type(cell))
    if why:
        return None, why
    for name, default in _RNN_DEFAULTS.items():
        if getattr(module, name) != default:
            return None, f"non-default {name}"
    if len(args) != 1 or set(kwargs) - _RNN_KWARGS:
        return None, "unexpected arguments"
    inputs = args[0]
    opt = {k: module.__getattribute__(k) if kwargs.get(k) is None else kwargs[k]
           for k in ("return_carry", "time_major", "reverse", "keep_order")}
    seq_lengths = kwargs.get("seq_lengths")
    if not hasattr(inputs, "ndim") or inputs.ndim < 3:
        return None, "inputs without a batch dim"
    if seq_lengths is not None and opt["return_carry"]:
        why = jbnn.recurrent.seq_lengths_problem(inputs, seq_lengths, opt["time_major"])[1]
        if why:
            return None, why
    # The cell's own scope: 'cell' under the RNN when the RNN adopted it (an RNN built
    # outside a module), or the cell's name in the enclosing module (built inside a compact
    # method, as in the Flax examples).
    try:
        params = cell.variables.get("params", {}) if cell.scope is not None else {}
    except Exception:  # an unbound cell  # noqa: BLE001
        params = {}
    initial_carry = kwargs.get("initial_carry")
    if initial_carry is None and _adapt.lstm_params(params)[0] is not None:
        time_axis = 0 if opt["time_major"] else inputs.ndim - 2
        init_key = kwargs.get("init_key")
        initial_carry = cell.initialize_carry(
            jax.random.key(0) if init_key is None else init_key,
            inputs.shape[:time_axis] + inputs.shape[time_axis + 1:])
    return _lstm_on_kernels(cell, params, inputs, initial_carry, seq_lengths=seq_lengths, **opt)


def _lstm_on_kernels(cell, params, inputs, initial_carry, **options):
    """A whole sequence of an LSTM cell with the stock parameters ``params`` as one fused
    call (``options`` those of ``jbnn.lstm_on_kernels``), or (None, why not)."""
    fused, why = _adapt.lstm_params(params)
    if fused is None:
        return None, why
    kernel_i, kernel_h, bias = fused
    k = cell.features
    if kernel_h.shape != (k, 4 * k) or kernel_i.shape != (inputs.shape[-1], 4 * k):
        return None, "parameter shapes do not match the inputs"
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
                                dtype=dtype, **options), ""


# --- nn.scan over an LSTM cell (Flax's sst2 example) ---------------------------------------
# nn.scan(cell_class, ...) makes a subclass of the cell whose __call__ runs the scan; flax
# marks that __call__ as already wrapped, so linen's intercept_methods never sees the scan,
# and keeps the scan's settings only in the __call__'s closure. Such classes are routed
# through the call interceptors of jax_brgemm.nnx._intercept instead, once and for good.

_LSTM_CELLS = (nn.OptimizedLSTMCell, nn.LSTMCell)
# the classes nn.scan made over an LSTM cell -> (the cell class, nn.scan's keyword arguments)
_SCANS: weakref.WeakKeyDictionary[type, tuple[type, dict]] = weakref.WeakKeyDictionary()
_watch_lock = threading.Lock()


def _scan_settings(cls: type):
    """``(cell class, nn.scan's keyword arguments)`` for a class that ``nn.scan(cell class,
    ...)`` made over ``__call__`` (flax.linen.transforms.module_class_lift_transform), read
    from its transformed ``__call__``'s closure; None for any other class."""
    call = cls.__dict__.get("__call__")
    names = getattr(getattr(call, "__code__", None), "co_freevars", ())
    try:
        free = {n: c.cell_contents for n, c in zip(names, call.__closure__ or ())}
    except (AttributeError, ValueError):  # no closure, or a cell not filled
        return None
    if (free.get("transform") is not lift.scan or free.get("fn_name") != "__call__"
            or free.get("trafo_args") != () or not isinstance(free.get("trafo_kwargs"), dict)
            or free.get("module_class") not in _LSTM_CELLS):
        return None
    return free["module_class"], dict(free["trafo_kwargs"])


def _watch_scan(cls: type) -> None:
    settings = _scan_settings(cls)
    if settings is not None and cls not in _SCANS:
        _SCANS[cls] = settings
        _intercept.wrap(cls)


def _watch_scans() -> None:
    """Routes through the interceptors the scans already made over the LSTM cells, and (a
    hook on the cells' ``__init_subclass__``, installed once) every one made later."""
    with _watch_lock:  # contexts entered in two threads at once install one hook
        for base in _LSTM_CELLS:
            if "_jax_brgemm_watched" not in base.__dict__:
                previous = base.__dict__.get("__init_subclass__")

                def hook(cls, _base=base, _previous=previous, **kwargs):
                    if _previous is not None:
                        _previous.__get__(None, cls)(**kwargs)
                    else:
                        super(_base, cls).__init_subclass__(**kwargs)
                    _watch_scan(cls)

                base.__init_subclass__ = classmethod(hook)
                base._jax_brgemm_watched = True
            for cls in base.__subclasses__():
                _watch_scan(cls)


def _scan_over_lstm(module, cell_class: type, scan: dict, args, kwargs, params=None):
    """``nn.scan(OptimizedLSTMCell / LSTMCell, variable_broadcast="params", ...)`` called on
    ``(carry, inputs)``: one fused call when the parameters are broadcast over time (not
    stacked, not carried), the time axis of the inputs and outputs is 0 or 1 of 3-D arrays
    and there is no data_transform; ``reverse`` runs the sequence from its end, each output
    in its own place (the RNN's reverse with keep_order). ``module`` is the cell (or the
    class nn.scan made over it); ``params`` its parameters, by default its own variables'."""
    why = _lstm_cell_why(module, cell_class) or scan_methods.scan_settings_why(scan)
    if why:
        return None, why
    if len(args) != 2 or kwargs:
        return None, "unexpected arguments"
    carry, inputs = args
    if getattr(inputs, "ndim", None) != 3:
        return None, "inputs other than one 3-D array"
    in_axis = scan_methods.time_axis(scan.get("in_axes"), 3)
    out_axis = scan_methods.time_axis(scan.get("out_axes"), 3)
    if in_axis is None or out_axis is None:
        return None, "nn.scan in_axes / out_axes other than 0 or 1 of 3-D arrays"
    if scan.get("length") not in (None, inputs.shape[in_axis]):
        return None, "nn.scan length other than the inputs' time steps"
    if params is None:
        params = module.variables.get("params", {})
    result, why = _lstm_on_kernels(module, params, inputs, carry,
                                   time_major=in_axis == 0, reverse=bool(scan.get("reverse")),
                                   keep_order=True, return_carry=True)
    if result is None:
        return None, why
    carry, outputs = result
    return (carry, outputs if in_axis == out_axis else jnp.swapaxes(outputs, 0, 1)), ""


def _dense_general(module: nn.DenseGeneral, args, kwargs):
    params = module.variables.get("params", {})
    if len(args) != 1 or kwargs or not hasattr(args[0], "ndim"):
        return None, "unexpected arguments"
    if "kernel" not in params or (module.use_bias and "bias" not in params):
        return None, "parameters not created yet"
    return jbnn.dense_general_on_kernels(module, args[0], params["kernel"], params.get("bias"))


def _einsum(module: nn.Einsum, args, kwargs):
    """An Einsum whose equation is a matrix product (``nnx_attention.einsum_on_kernels``)."""
    params = module.variables.get("params", {})
    if not 1 <= len(args) <= 2 or set(kwargs) - {"einsum_str"} or not hasattr(args[0], "ndim"):
        return None, "unexpected arguments"
    if "kernel" not in params or (module.use_bias and "bias" not in params):
        return None, "parameters not created yet"
    spec = args[1] if len(args) == 2 else kwargs.get("einsum_str")
    if (spec is None) == (module.einsum_str is None):
        return None, "einsum_str given twice or not at all"
    return nnx_attention.einsum_on_kernels(nnx_attention.linen_view(module), spec or module.einsum_str,
                                           args[0], params["kernel"], params.get("bias"))


_RULES: dict[type, Callable[..., Any]] = {nn.Dense: _dense, nn.Conv: _conv, nn.RNN: _rnn,
                                          nn.DenseGeneral: _dense_general, nn.Einsum: _einsum}
_CELLS = (nn.OptimizedLSTMCell, nn.LSTMCell, nn.GRUCell, nn.SimpleCell, nn.MGUCell,
          nn.ConvLSTMCell)

__all__ = ["accelerate", "Accelerate", "Call"]
