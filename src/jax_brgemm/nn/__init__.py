"""Flax modules on jax_brgemm's kernels, drop-in replacements for their ``flax.linen`` twins.

Each module has its stock twin's fields, in the stock order, followed by its own (such as
``activation``); it creates exactly the stock module's parameters (names, shapes, dtypes,
initializers), so a checkpoint of a stock Flax model loads unchanged. A configuration the
kernels cannot run (a custom ``dot_general``, a dtype other than float32 / bfloat16, a
``promote_dtype`` whose result they cannot take) computes exactly as the stock module does.

``dense_on_kernels``, ``conv_on_kernels`` and ``lstm_on_kernels`` run a stock layer's call on
the kernels from its fields and parameters: what the modules and ``jax_brgemm.accelerate()``
both compute with; ``attention_on_kernels`` likewise runs ``flax.linen.dot_product_attention``'s,
``dense_general_on_kernels`` a ``DenseGeneral``'s, and ``dot_product_attention`` is a drop-in
``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention``; ``MultiHeadDotProductAttention``
is that module with its attention and projections on the kernels.
"""

from __future__ import annotations

from typing import Callable

from flax.typing import Array

from jax_brgemm import _activations
from jax_brgemm.nn.attention import (ATTENTION_MODULES, MultiHeadDotProductAttention, attention_module_reason,
                                     attention_on_kernels, dense_general_on_kernels, dot_product_attention)
from jax_brgemm.nn.linear import Conv, Dense, conv_on_kernels, dense_on_kernels
from jax_brgemm.nn.recurrent import LSTM, lstm_on_kernels

__all__ = ["ACTIVATIONS", "ATTENTION_MODULES", "Conv", "Dense", "LSTM", "MultiHeadDotProductAttention",
           "attention_module_reason", "attention_on_kernels", "conv_on_kernels", "dense_general_on_kernels",
           "dense_on_kernels", "dot_product_attention", "lstm_on_kernels"]

#: The activations the modules fuse, by name, and the stock function each one matches
#: (what a stock layer followed by that function computes).
ACTIVATIONS: dict[str, Callable[[Array], Array]] = dict(_activations.FUNCTIONS)
