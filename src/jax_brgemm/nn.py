"""Flax modules on jax_brgemm's kernels, drop-in replacements for their ``flax.linen`` twins.

Each module creates exactly the parameters of the stock module it replaces (names, shapes,
dtypes, initializers), so a checkpoint of a stock Flax model loads unchanged; only the
computation runs on the BRGEMM kernels, with the activation fused into them.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax.linen import initializers
from flax.linen.dtypes import canonicalize_dtype
from flax.linen.linear import default_kernel_init
from flax.linen.module import Module, compact
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jax_brgemm.ops.dense import ACTIVATIONS, dense

__all__ = ["Dense"]


def _compute_dtype(*args, dtype: Any = None) -> np.dtype:
    """Flax's dtype promotion (``promote_dtype``), restricted to the kernels' dtypes."""
    dtype = np.dtype(canonicalize_dtype(*args, dtype=dtype))
    if dtype not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise TypeError(f"jax_brgemm.nn: the computation dtype must be float32 or bfloat16, got "
                        f"{dtype}; use the flax.linen module for other dtypes")
    return dtype


class Dense(Module):
    """A linear transformation applied over the last dimension of the input, with an
    optional fused activation, on jax_brgemm's fully-connected kernels.

    Same parameters as ``flax.linen.Dense``::

      >>> import jax, jax.numpy as jnp
      >>> import jax_brgemm as jb
      >>> layer = jb.nn.Dense(features=4, activation="relu")
      >>> params = layer.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> jax.tree_util.tree_map(jnp.shape, params)
      {'params': {'bias': (4,), 'kernel': (3, 4)}}

    Attributes:
      features: the number of output features.
      use_bias: whether to add a bias to the output (default: True).
      activation: ``None``, ``"relu"``, ``"gelu"`` (tanh approximation, as
        ``flax.linen.gelu``), ``"sigmoid"`` or ``"tanh"``, applied in the kernel while the
        output is in registers (default: None).
      dtype: the dtype of the computation, float32 or bfloat16 (default: infer from input
        and params). bfloat16 computes with float32 accumulation, bias and activation.
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: accepted for compatibility with ``flax.linen.Dense``; the kernels always
        multiply in the computation dtype and accumulate in float32.
      kernel_init: initializer function for the weight matrix.
      bias_init: initializer function for the bias.
    """

    features: int
    use_bias: bool = True
    activation: str | None = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = initializers.zeros_init()

    @compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the layer to the last dimension of ``inputs``.

        Args:
          inputs: the nd-array to be transformed.

        Returns:
          The transformed input, in the computation dtype.
        """
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"Dense: unknown activation {self.activation!r}; expected None or "
                             f"one of {sorted(a for a in ACTIVATIONS if a)}")
        kernel = self.param(
            'kernel',
            self.kernel_init,
            (jnp.shape(inputs)[-1], self.features),
            self.param_dtype,
        )
        if self.use_bias:
            bias = self.param('bias', self.bias_init, (self.features,), self.param_dtype)
        else:
            bias = None
        dtype = _compute_dtype(inputs, kernel, bias, dtype=self.dtype)
        # Like promote_dtype for the inputs; the kernel and bias go in as they are and are
        # cast inside the custom call, so their gradients stay in the parameter dtype.
        inputs = jnp.asarray(inputs, dtype)
        return dense(inputs, kernel, bias, activation=self.activation, dtype=dtype)
