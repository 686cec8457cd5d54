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


# --- Conv ---------------------------------------------------------------------------------

from typing import Sequence  # noqa: E402

from jax_brgemm.ops.conv import conv2d  # noqa: E402

__all__ += ["Conv"]


class Conv(Module):
    """A convolution (1-D or 2-D, channels last) with an optional fused activation, on
    jax_brgemm's convolution kernels.

    Same parameters as ``flax.linen.Conv`` (names, shapes, initializers, dtypes), so a
    stock checkpoint loads unchanged::

      >>> import jax, jax.numpy as jnp
      >>> import jax_brgemm as jb
      >>> layer = jb.nn.Conv(features=4, kernel_size=(3, 3), activation="relu")
      >>> params = layer.init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
      >>> jax.tree_util.tree_map(jnp.shape, params)
      {'params': {'bias': (4,), 'kernel': (3, 3, 3, 4)}}

    Attributes:
      features: number of convolution filters.
      kernel_size: shape of the kernel, a pair for a 2-D convolution; an int or a 1-tuple is
        a 1-D convolution (as in Flax).
      strides: an int or a sequence of ints, the inter-window strides (default: 1).
      padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'`` (1-D
        only), an int, or a sequence of ints / ``(low, high)`` pairs, as in Flax.
      input_dilation, kernel_dilation, feature_group_count: accepted for compatibility;
        anything but 1 raises a ValueError naming ``flax.linen.Conv``, which supports them.
      use_bias: whether to add a bias to the output (default: True).
      mask: optional mask for the weights, multiplied in as in Flax.
      dtype: the dtype of the computation, float32 or bfloat16 (default: infer from input
        and params). bfloat16 computes with float32 accumulation, bias and activation.
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: accepted for compatibility; the kernels multiply in the computation dtype
        and accumulate in float32.
      kernel_init: initializer for the convolutional kernel.
      bias_init: initializer for the bias.
      activation: ``None``, ``"relu"``, ``"gelu"``, ``"sigmoid"`` or ``"tanh"``, applied in
        the kernel while the output is in registers (default: None).
    """

    features: int
    kernel_size: int | Sequence[int]
    strides: None | int | Sequence[int] = 1
    padding: Any = 'SAME'
    input_dilation: None | int | Sequence[int] = 1
    kernel_dilation: None | int | Sequence[int] = 1
    feature_group_count: int = 1
    use_bias: bool = True
    mask: Array | None = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = initializers.zeros_init()
    activation: str | None = None

    @compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the convolution to ``inputs``: ``(*batch_dims, spatial..., features)``;
        several batch dims are flattened and restored, none is added and removed (as Flax).

        Returns:
          The convolved data, in the computation dtype.
        """
        kernel_size = ((self.kernel_size,) if isinstance(self.kernel_size, int)
                       else tuple(self.kernel_size))
        rank = len(kernel_size)
        if rank not in (1, 2):
            raise ValueError(f"jax_brgemm.nn.Conv: {rank}-D convolutions are not supported (1-D and "
                             "2-D only); use flax.linen.Conv")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"Conv: unknown activation {self.activation!r}; expected None or one "
                             f"of {sorted(a for a in ACTIVATIONS if a)}")

        def broadcast(v, what):
            v = 1 if v is None else v
            v = (v,) * rank if isinstance(v, int) else tuple(v)
            if len(v) != rank:
                raise ValueError(f"Conv: {what} {v} must have one entry per spatial dim ({rank})")
            return v

        strides = broadcast(self.strides, "strides")
        for what, v in (("input_dilation", self.input_dilation), ("kernel_dilation", self.kernel_dilation)):
            if any(d != 1 for d in broadcast(v, what)):
                raise ValueError(f"jax_brgemm.nn.Conv: {what}={v} is not supported; use flax.linen.Conv")
        if self.feature_group_count != 1:
            raise ValueError(f"jax_brgemm.nn.Conv: feature_group_count={self.feature_group_count} is "
                             "not supported; use flax.linen.Conv")

        inputs = jnp.asarray(inputs)
        batch_dims = inputs.ndim - (rank + 1)
        if batch_dims < 0:
            raise ValueError(f"Conv: a {rank}-D convolution needs inputs of rank >= {rank + 1} "
                             f"(spatial dims and features), got shape {inputs.shape}")
        batch_shape = inputs.shape[:batch_dims]
        if batch_dims != 1:
            inputs = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])

        padding = self.padding
        if isinstance(padding, str) and padding.upper() in ('CIRCULAR', 'REFLECT'):
            pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in kernel_size] + [(0, 0)]
            inputs = jnp.pad(inputs, pads, mode={'CIRCULAR': 'wrap', 'REFLECT': 'reflect'}[padding.upper()])
            padding = 'VALID'
        elif isinstance(padding, str) and padding.upper() == 'CAUSAL':
            if rank != 1:
                raise ValueError('Causal padding is only implemented for 1D convolutions.')
            padding = [(kernel_size[0] - 1, 0)]

        in_features = jnp.shape(inputs)[-1]
        kernel_shape = kernel_size + (in_features, self.features)
        if self.mask is not None and self.mask.shape != kernel_shape:
            raise ValueError('Mask needs to have the same shape as weights. '
                             f'Shapes are: {self.mask.shape}, {kernel_shape}')
        kernel = self.param('kernel', self.kernel_init, kernel_shape, self.param_dtype)
        if self.mask is not None:
            kernel = kernel * self.mask
        bias = self.param('bias', self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        dtype = _compute_dtype(inputs, kernel, bias, dtype=self.dtype)
        inputs = jnp.asarray(inputs, dtype)

        if rank == 1:  # a 1-D convolution is a 2-D one over a single row
            if not isinstance(padding, str):
                padding = [(0, 0)] + list(_conv_pads_1d(padding))
            y = conv2d(inputs[:, None], kernel[None], bias, strides=(1,) + strides, padding=padding,
                       activation=self.activation, dtype=dtype)[:, 0]
        else:
            y = conv2d(inputs, kernel, bias, strides=strides, padding=padding,
                       activation=self.activation, dtype=dtype)
        if batch_dims != 1:
            y = jnp.reshape(y, batch_shape + y.shape[1:])
        return y


def _conv_pads_1d(padding):
    """A 1-D Flax padding (int, [int] or [(low, high)]) as one (low, high) pair."""
    if isinstance(padding, int):
        return [(padding, padding)]
    if isinstance(padding, Sequence) and len(padding) == 1:
        p = padding[0]
        return [(p, p)] if isinstance(p, int) else [tuple(p)]
    raise ValueError(f"Conv: invalid 1-D padding {padding!r}: expected an int or one int / (low, high) pair")
