"""Multi-layer perceptron, switchable between BRGEMM and stock XLA dense layers."""

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from .layers import activated, check_activation, layers


class MLP(nn.Module):
    """Fully-connected classifier: flatten, hidden layers with an activation, logits.

    Both implementations create the same parameters under the same names
    (``Dense_0`` ... ``Dense_<n>``), so a checkpoint of one loads into the other.

    Attributes:
      features: widths of the hidden layers.
      num_classes: width of the output (logits) layer.
      activation: one of ``ACTIVATIONS``, applied after every hidden layer.
      impl: ``"brgemm"`` (``jax_brgemm.nn.Dense``, activation fused into the
        kernel) or ``"xla"`` (``flax.linen.Dense`` followed by the activation).
      dtype: computation dtype (``None``: inferred from inputs and params).
      param_dtype: dtype of the parameters.
      dense: the dense layer class (``flax.linen.Dense`` or a drop-in for it); None takes
        the one ``impl`` names.
    """

    features: Sequence[int]
    num_classes: int
    activation: str = "relu"
    impl: str = "brgemm"
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    dense: Optional[type] = None

    @nn.compact
    def __call__(self, x):
        dense = self.dense or layers(self.impl, "MLP").dense
        check_activation(self.activation, "MLP")
        if not all(int(f) > 0 for f in self.features) or self.num_classes <= 0:
            raise ValueError(
                f"MLP widths must be positive, got features={tuple(self.features)}, "
                f"num_classes={self.num_classes}")
        x = x.reshape((x.shape[0], -1))
        widths = [*self.features, self.num_classes]
        for i, width in enumerate(widths):
            activation = self.activation if i < len(widths) - 1 else None
            x = activated(dense, activation, features=width, dtype=self.dtype,
                          param_dtype=self.param_dtype, name=f"Dense_{i}")(x)
        return x
