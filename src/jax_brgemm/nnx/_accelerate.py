"""``accelerate()``'s rules for stock ``flax.nnx`` layers.

Each rule takes ``(module, next_call, args, kwargs)``, the intercepted call of a stock
module, and returns ``(result, why not)``: the result on the kernels with ``why == ""``, or
``next_call(*args, **kwargs)``'s (the stock computation) with the reason.
"""

from __future__ import annotations

from typing import Any, Callable

from flax.nnx.nn import linear as stock_linear
from flax.nnx.nn import recurrent as stock_recurrent

from jax_brgemm import nn as jbnn
from jax_brgemm.nnx import _intercept
from jax_brgemm.nnx import attention
from jax_brgemm.nnx.linear import kernel_and_bias
from jax_brgemm.nnx.recurrent import rnn_call

_RNN_KWARGS = {"initial_carry", "seq_lengths", "return_carry", "time_major", "reverse",
               "keep_order", "rngs"}


def _one_input(module, args, kwargs, allowed=("out_sharding",)):
    """Why a Linear / Conv call is not one the kernels take ("" when it is)."""
    if len(args) != 1 or set(kwargs) - set(allowed):
        return "unexpected arguments"
    if kwargs.get("out_sharding") is not None:
        return "out_sharding"
    shape = getattr(args[0], "shape", None)
    if shape is None or len(shape) < 1 or shape[-1] != module.in_features:
        return "inputs do not match in_features"
    return ""


def linear(module, next_call, args, kwargs):
    why = _one_input(module, args, kwargs)
    y = None
    if not why:
        y, why = jbnn.dense_on_kernels(module, args[0], *kernel_and_bias(module))
    return (y, "") if y is not None else (next_call(*args, **kwargs), why)


def conv(module, next_call, args, kwargs):
    why = _one_input(module, args, kwargs)
    if not why and len(args[0].shape) < len(module.kernel_size) + 1:
        why = "inputs without spatial dims"
    y = None
    if not why:
        y, why = jbnn.conv_on_kernels(module, args[0], *kernel_and_bias(module))
    return (y, "") if y is not None else (next_call(*args, **kwargs), why)


def rnn(module, next_call, args, kwargs):
    if len(args) != 1 or set(kwargs) - _RNN_KWARGS:
        return next_call(*args, **kwargs), "unexpected arguments"
    return rnn_call(module, next_call, args[0], **kwargs)


#: The stock classes whose calls run on the kernels (exactly these classes: a subclass may
#: compute something else), and their rules.
RULES: dict[type, Callable[..., Any]] = {
    stock_linear.Linear: linear,
    stock_linear.Conv: conv,
    stock_recurrent.RNN: rnn,
    **attention.RULES,
}

#: The stock cells: called by anything but an intercepted RNN (a loop, ``nnx.scan``), their
#: layers are per-step work, which a report says.
CELLS = (stock_recurrent.OptimizedLSTMCell, stock_recurrent.LSTMCell, stock_recurrent.GRUCell,
         stock_recurrent.SimpleCell)

stock_scan = _intercept.stock_scan
enclosing_stock_scan = _intercept.enclosing_stock_scan


def intercept_calls(interceptor):
    """Within the context, in this thread, calls of the ``RULES`` and ``CELLS`` classes go
    through ``interceptor(module, next_call, *args, **kwargs)``."""
    return _intercept.intercept_calls(interceptor, (*RULES, *CELLS))


def describe(module) -> str:
    """A name for an NNX layer in a report (NNX modules do not know their path): the class
    and its sizes, e.g. ``nnx.Linear(784 -> 128)``; a projection of a MultiHeadAttention
    being called, by its attribute, e.g. ``nnx.MultiHeadAttention(4 heads, 32 -> 32)/query``."""
    parent = attention.enclosing(module)
    if parent is not None:
        return f"{describe(parent[0])}/{parent[1]}"
    name = f"nnx.{type(module).__name__}"
    if isinstance(module, stock_recurrent.RNN):
        return f"{name}({describe(module.cell)})"
    if isinstance(module, stock_linear.Einsum):
        return f"{name}({module.einsum_str!r})"
    sizes = [getattr(module, a, None) for a in ("in_features", "out_features",
                                                 "hidden_features")]
    text = " -> ".join(_size(v) for v in sizes if v is not None)
    if isinstance(module, stock_linear.Conv):
        text += f", kernel {tuple(module.kernel_size)}"
    if isinstance(module, attention.stock_attention.MultiHeadAttention):
        text = f"{module.num_heads} heads, {text}"
    return f"{name}({text})"


def _size(features) -> str:
    """A layer's feature count, or LinearGeneral's tuple of them as ``4x8``."""
    if isinstance(features, tuple):
        return "x".join(map(str, features))
    return str(features)
