"""Flax NNX modules on jax_brgemm's kernels, drop-in replacements for their ``flax.nnx`` twins.

``Linear``, ``Conv`` and ``RNN`` subclass ``flax.nnx.Linear``, ``flax.nnx.Conv`` and
``flax.nnx.RNN`` and keep their constructors (plus ``activation=`` after the stock
arguments of ``Linear`` / ``Conv``); ``LSTM`` is ``RNN`` over a stock
``flax.nnx.OptimizedLSTMCell`` built from the same arguments. Each creates exactly the stock
module's state from the same ``rngs``, so ``nnx.state`` trees and checkpoints interchange.
What the kernels cannot run computes with the stock module's own code.
"""

from jax_brgemm.nnx.linear import Conv, ConvTranspose, Linear
from jax_brgemm.nnx.recurrent import LSTM, RNN, lstm_params

__all__ = ["Conv", "ConvTranspose", "LSTM", "Linear", "RNN", "lstm_params"]
