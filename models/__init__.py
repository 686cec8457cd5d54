"""Models built on jax_brgemm layers, each switchable to stock XLA layers (``impl="xla"``)."""

from .layers import ACTIVATIONS, IMPLS, LAYERS, Layers, activated, layers
from .mlp import MLP

__all__ = ["ACTIVATIONS", "IMPLS", "LAYERS", "Layers", "MLP", "activated", "layers"]
