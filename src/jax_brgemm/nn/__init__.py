"""Flax modules on jax_brgemm's kernels, drop-in replacements for their ``flax.linen`` twins.

Each module has its stock twin's fields, in the stock order, followed by its own (such as
``activation``); it creates exactly the stock module's parameters (names, shapes, dtypes,
initializers), so a checkpoint of a stock Flax model loads unchanged. A configuration the
kernels cannot run (a custom ``dot_general``, a dtype other than float32 / bfloat16, a
``promote_dtype`` whose result they cannot take) computes exactly as the stock module does.

``dot_product_attention`` is a drop-in ``attention_fn`` for
``flax.linen.MultiHeadDotProductAttention``; ``MultiHeadDotProductAttention`` is that module
with its attention and projections on the kernels.
"""

from __future__ import annotations

# ACTIVATIONS: the activations the modules fuse, by name, and the stock function each one
# matches (what a stock layer followed by that function computes); the package's one table.
from jax_brgemm._activations import ACTIVATIONS
from jax_brgemm.nn.attention import MultiHeadDotProductAttention, dot_product_attention
from jax_brgemm.nn.conv import Conv, ConvTranspose
from jax_brgemm.nn.linear import Dense
from jax_brgemm.nn.recurrent import LSTM

__all__ = ["ACTIVATIONS", "Conv", "ConvTranspose", "Dense", "LSTM", "MultiHeadDotProductAttention", "dot_product_attention"]
