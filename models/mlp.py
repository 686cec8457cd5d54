"""Multi-layer perceptron, switchable between BRGEMM and stock XLA dense layers."""

from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

# The activations jax_brgemm.nn.Dense can fuse, and what they mean for the XLA path
# (gelu is the tanh approximation in both, as flax.linen.gelu).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
}

IMPLS = ("brgemm", "xla")


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
    """

    features: Sequence[int]
    num_classes: int
    activation: str = "relu"
    impl: str = "brgemm"
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        self._check()
        x = x.reshape((x.shape[0], -1))
        widths = [*self.features, self.num_classes]
        for i, width in enumerate(widths):
            activation = self.activation if i < len(widths) - 1 else None
            kwargs = dict(dtype=self.dtype, param_dtype=self.param_dtype, name=f"Dense_{i}")
            if self.impl == "xla":
                x = nn.Dense(width, **kwargs)(x)
                if activation is not None:
                    x = ACTIVATIONS[activation](x)
            else:
                # Imported lazily: impl="xla" does not need jax_brgemm.nn at all.
                from jax_brgemm import nn as jbnn

                x = jbnn.Dense(width, activation=activation, **kwargs)(x)
        return x

    def _check(self):
        if self.impl not in IMPLS:
            raise ValueError(f"MLP impl must be one of {IMPLS}, got {self.impl!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"MLP activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")
        if not all(int(f) > 0 for f in self.features) or self.num_classes <= 0:
            raise ValueError(
                f"MLP widths must be positive, got features={tuple(self.features)}, "
                f"num_classes={self.num_classes}")
