"""The rules of ``accelerate()`` for recurrent layers: linen's ``nn.RNN`` and ``nn.scan`` over
an LSTM cell (or over a method whose body is one cell step), NNX's ``nnx.RNN``; each a whole
sequence as one fused ``jb.lstm`` call on the stock cell's parameters.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm import _validate as check
from jax_brgemm.accelerate import scans
from jax_brgemm.nn import _adapt
from jax_brgemm.nn._adapt import Decision
from jax_brgemm.nn.recurrent import lstm_on_kernels, seq_lengths_problem
from jax_brgemm.nnx.recurrent import rnn_on_kernels

_RNN_KWARGS = {"initial_carry", "init_key", "seq_lengths", "return_carry", "time_major",
               "reverse", "keep_order"}
_NNX_RNN_KWARGS = {"initial_carry", "seq_lengths", "return_carry", "time_major", "reverse",
                   "keep_order", "rngs"}
# RNN's scan settings the fused call reproduces (the defaults: parameters broadcast over time).
_RNN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(nn.RNN)
                 if f.name in ("variable_axes", "variable_broadcast", "variable_carry")}


def _lstm_cell_why(cell, cell_class: type) -> str:
    """Why the fused layer does not compute what this linen cell (of class ``cell_class``,
    or made by nn.scan over it) does ("" when it does)."""
    if cell_class not in scans.LSTM_CELLS:
        return f"cell {cell_class.__name__}"
    if not _adapt.sigmoid_tanh_gates(cell):
        return "gate_fn / activation_fn other than sigmoid / tanh"
    return ""


def linen_rnn(module: nn.RNN, args, kwargs) -> Decision:
    """RNN over OptimizedLSTMCell / LSTMCell: both cells create the same parameters and
    compute the same gates (i, f, g, o = sigmoid, sigmoid, tanh, sigmoid; c' = f c + i g,
    h' = o tanh c'), which the fused layer takes concatenated (``_adapt.lstm_params``)."""
    cell = module.cell
    why = _lstm_cell_why(cell, type(cell))
    if why:
        return Decision.stock(why)
    for name, default in _RNN_DEFAULTS.items():
        if getattr(module, name) != default:
            return Decision.stock(f"non-default {name}")
    if len(args) != 1 or set(kwargs) - _RNN_KWARGS:
        return Decision.stock("unexpected arguments")
    inputs = args[0]
    opt = {k: module.__getattribute__(k) if kwargs.get(k) is None else kwargs[k]
           for k in ("return_carry", "time_major", "reverse", "keep_order")}
    seq_lengths = kwargs.get("seq_lengths")
    if not hasattr(inputs, "ndim") or inputs.ndim < 3:
        return Decision.stock("inputs without a batch dim")
    if seq_lengths is not None and opt["return_carry"]:
        why = seq_lengths_problem(inputs, seq_lengths, opt["time_major"])[1]
        if why:
            return Decision.stock(why)
    # The cell's own scope: 'cell' under the RNN when the RNN adopted it (an RNN built
    # outside a module), or the cell's name in the enclosing module (built inside a compact
    # method, as in the Flax examples).
    try:
        params = cell.variables.get("params", {}) if cell.scope is not None else {}
    except Exception:  # an unbound cell  # noqa: BLE001
        params = {}
    initial_carry = kwargs.get("initial_carry")
    if initial_carry is None and _adapt.lstm_params(params).taken:
        time_axis = 0 if opt["time_major"] else inputs.ndim - 2
        init_key = kwargs.get("init_key")
        initial_carry = cell.initialize_carry(
            jax.random.key(0) if init_key is None else init_key,
            inputs.shape[:time_axis] + inputs.shape[time_axis + 1:])
    return _lstm(cell, params, inputs, initial_carry, seq_lengths=seq_lengths, **opt)


def _lstm(cell, params, inputs, initial_carry, **options) -> Decision:
    """A whole sequence of a linen LSTM cell with the stock parameters ``params`` as one
    fused call (``options`` those of ``lstm_on_kernels``)."""
    fused = _adapt.lstm_params(params)
    if not fused.taken:
        return fused
    kernel_i, kernel_h, bias = fused.value
    k = cell.features
    if kernel_h.shape != (k, 4 * k) or kernel_i.shape != (inputs.shape[-1], 4 * k):
        return Decision.stock("parameter shapes do not match the inputs")
    try:
        c0, h0 = initial_carry
    except (TypeError, ValueError):
        return Decision.stock("initial_carry is not a pair (c, h)")
    # The stock computation's dtype: the cell's promote_dtype of the inputs, the carry and
    # the parameters (dtype=None) or the cell's dtype.
    dtype, why = _adapt.computation_dtype(cell.dtype, inputs, h0, kernel_i, kernel_h, bias)
    if why:
        return Decision.stock(why)
    if any(np.dtype(a.dtype) not in check.KERNEL_DTYPES for a in (kernel_i, kernel_h, bias)):
        return Decision.stock("parameters neither float32 nor bfloat16")
    return Decision(lstm_on_kernels(inputs.astype(dtype), kernel_i, kernel_h, bias, (c0, h0),
                                    dtype=dtype, **options))


def linen_scan(module, scan: scans.Scan, args, kwargs) -> Decision:
    """A call of a method ``nn.scan`` made: over an LSTM cell class (Flax's sst2 pattern,
    ``nn.scan(OptimizedLSTMCell, variable_broadcast="params", ...)(carry, inputs)``) or over
    a method whose body only calls one such cell on its own ``(carry, x)`` and returns its
    result (the sst2 example's ``SimpleLSTM``): one fused call when the parameters are
    broadcast over time, the time axis of the inputs and outputs is 0 or 1 of 3-D arrays and
    there is no data_transform; ``reverse`` runs the sequence from its end, each output in
    its own place (the RNN's reverse with keep_order)."""
    settings = scan.settings
    why = scans.scan_settings_why(settings)
    if why:
        return Decision.stock(why)
    if len(args) != 2 or kwargs:
        return Decision.stock("unexpected arguments")
    carry, inputs = args
    if getattr(inputs, "ndim", None) != 3:
        return Decision.stock("inputs other than one 3-D array")
    in_axis = scans.time_axis(settings.get("in_axes"), 3)
    out_axis = scans.time_axis(settings.get("out_axes"), 3)
    if in_axis is None or out_axis is None:
        return Decision.stock("nn.scan in_axes / out_axes other than 0 or 1 of 3-D arrays")
    if settings.get("length") not in (None, inputs.shape[in_axis]):
        return Decision.stock("nn.scan length other than the inputs' time steps")
    cell, cell_class, params = module, scan.cell_class, None
    if scan.body is not None:
        step = scans.lstm_step(module, scan.body, carry, inputs, in_axis)
        if not step.taken:
            return step
        cell, params = step.value
        cell_class = type(cell)
    why = _lstm_cell_why(cell, cell_class)
    if why:
        return Decision.stock(why)
    if params is None:
        params = module.variables.get("params", {})
    result = _lstm(cell, params, inputs, carry, time_major=in_axis == 0,
                   reverse=bool(settings.get("reverse")), keep_order=True, return_carry=True)
    if not result.taken:
        return result
    carry, outputs = result.value
    return Decision((carry, outputs if in_axis == out_axis else jnp.swapaxes(outputs, 0, 1)))


def nnx_rnn(module, args, kwargs) -> Decision:
    if len(args) != 1 or set(kwargs) - _NNX_RNN_KWARGS:
        return Decision.stock("unexpected arguments")
    return rnn_on_kernels(module, args[0], **kwargs)
