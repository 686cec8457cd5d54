"""Models built on jax_brgemm layers, each switchable to stock XLA layers (``impl="xla"``)."""

from .mlp import MLP

__all__ = ["MLP"]
