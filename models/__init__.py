"""Models built on jax_brgemm layers, each switchable to stock XLA layers (``impl="xla"``)."""

from .layers import ACTIVATIONS, IMPLS, LAYERS, Layers, activated, layers, stock_lstm
from .lstm import GNMTEncoder, LSTMClassifier
from .mlp import MLP

__all__ = ["ACTIVATIONS", "IMPLS", "LAYERS", "GNMTEncoder", "LSTMClassifier", "Layers", "MLP",
           "activated", "layers", "stock_lstm"]
