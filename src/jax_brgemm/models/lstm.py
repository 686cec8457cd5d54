"""LSTM networks, switchable between the fused BRGEMM LSTM and stock Flax's
``flax.linen.RNN(flax.linen.OptimizedLSTMCell)`` with the same parameters."""

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from .layers import layers


def _widths(model: str, features: Sequence[int], **more) -> None:
    if not features or not all(int(f) > 0 for f in features) or any(v <= 0 for v in more.values()):
        raise ValueError(f"{model} widths must be positive, got features={tuple(features)}" +
                         "".join(f", {k}={v}" for k, v in more.items()))


class LSTMClassifier(nn.Module):
    """Stacked LSTM layers over a sequence, then a Dense head on the last step's output.

    Inputs are ``(N, T, C)``: N sequences of T steps of C features (e.g. Fashion-MNIST
    images as 28 rows of 28 pixels). Both implementations create the same parameters
    under the same names (``LSTM_0`` ... ``LSTM_<n-1>``, each ``{'cell': {...}}`` as
    ``flax.linen.RNN(OptimizedLSTMCell)`` has it, and ``Dense_0``), so a checkpoint of one
    loads into the other.

    Attributes:
      features: the hidden size of every LSTM layer, first to last.
      num_classes: width of the output (logits) layer.
      impl: ``"brgemm"`` (``jax_brgemm.nn.LSTM`` / ``Dense``) or ``"xla"`` (stock Flax).
      dtype: computation dtype (``None``: inferred from inputs and params).
      param_dtype: dtype of the parameters.
      lstm, dense: the layer factories (see ``Layers``); None takes the ones ``impl`` names.
    """

    features: Sequence[int]
    num_classes: int
    impl: str = "brgemm"
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    lstm: Optional[Any] = None
    dense: Optional[type] = None

    @nn.compact
    def __call__(self, x):
        chosen = layers(self.impl, "LSTMClassifier")
        lstm, dense = self.lstm or chosen.lstm, self.dense or chosen.dense
        _widths("LSTMClassifier", self.features, num_classes=self.num_classes)
        for i, width in enumerate(self.features):
            x = lstm(width, dtype=self.dtype, param_dtype=self.param_dtype, name=f"LSTM_{i}")(x)
        return dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                     name="Dense_0")(x[:, -1])


class GNMTEncoder(nn.Module):
    """The GNMT encoder's LSTM stack (Wu et al. 2016): a bidirectional first layer (forward
    and reversed outputs concatenated), then unidirectional layers, with residual
    connections from the third layer on (``x = x + lstm(x)``). Inputs ``(N, T, C)``
    (already embedded), outputs ``(N, T, features)``.

    Parameters: ``LSTM_0_fw``, ``LSTM_0_bw`` (the first layer's two directions), then
    ``LSTM_1`` ... ``LSTM_<layers-1>``, identical for both implementations.

    Attributes:
      features: the hidden size of every layer.
      num_layers: layers counting the bidirectional one as one (GNMT: 4 here; 8 in the paper).
      residual_from: the first layer (1-based) with a residual connection (GNMT: 3).
      impl, dtype, param_dtype, lstm: as ``LSTMClassifier``'s.
    """

    features: int
    num_layers: int = 4
    residual_from: int = 3
    impl: str = "brgemm"
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    lstm: Optional[Any] = None

    @nn.compact
    def __call__(self, x):
        lstm = self.lstm or layers(self.impl, "GNMTEncoder").lstm
        _widths("GNMTEncoder", [self.features], num_layers=self.num_layers)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        fw = lstm(self.features, name="LSTM_0_fw", **kw)(x)
        bw = lstm(self.features, reverse=True, keep_order=True, name="LSTM_0_bw", **kw)(x)
        x = jnp.concatenate([fw, bw], axis=-1)
        for i in range(1, self.num_layers):
            y = lstm(self.features, name=f"LSTM_{i}", **kw)(x)
            x = x + y if i + 1 >= self.residual_from else y
        return x
