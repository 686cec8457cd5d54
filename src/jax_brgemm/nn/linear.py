"""``Dense`` and ``Conv``: ``flax.linen``'s linear layers on the fully-connected and
convolution kernels, and the functions that run a stock layer's call on them (for
``accelerate()``)."""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from flax.linen import initializers
from flax.linen.dtypes import promote_dtype
from flax.linen.linear import PromoteDtypeFn, canonicalize_padding, default_kernel_init
from flax.linen.module import Module, compact
from flax.typing import Array, DotGeneralT, Dtype, Initializer, PrecisionLike
from jax import lax

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm.nn import _adapt
from jax_brgemm.nn._adapt import Decision
from jax_brgemm.ops.conv import conv2d
from jax_brgemm.ops.dense import dense

__all__ = ["Conv", "Dense", "conv_on_kernels", "dense_on_kernels"]


def dense_on_kernels(layer, inputs, kernel, bias, activation=None, *, stays_stock=None):
    """A Dense ``layer``'s result on the kernels, as a ``Decision``.

    ``layer`` has ``flax.linen.Dense``'s fields (``dtype``, ``promote_dtype``,
    ``dot_general``, ``dot_general_cls``) or ``flax.nnx.Linear``'s: a stock module or a
    jax_brgemm one. ``stays_stock(dtype, rows)``, when given, may leave the call to the
    stock code by returning why (``accelerate()``'s dispatch policy).
    """
    if _adapt.custom_dot_general(layer):
        return Decision.stock("custom dot_general")
    operands = _adapt.kernel_operands(layer, inputs, kernel, bias)
    if not operands.taken:
        return operands
    inputs, kernel, bias, dtype = operands.value
    why = stays_stock(dtype, int(np.prod(inputs.shape[:-1]))) if stays_stock else ""
    if why:
        return Decision.stock(why)
    return Decision(dense(inputs, kernel, bias, activation=activation, dtype=dtype))


class Dense(Module):
    """A linear transformation applied over the last dimension of the input, with an
    optional fused activation, on jax_brgemm's fully-connected kernels.

    A drop-in for ``flax.linen.Dense``: the same fields in the same order (so positional
    construction such as ``Dense(4, True, jnp.bfloat16)`` means what it means there), the
    same parameters, the same results; ``activation`` comes after the stock fields::

      >>> import jax, jax.numpy as jnp
      >>> import jax_brgemm as jb
      >>> layer = jb.nn.Dense(features=4, activation="relu")
      >>> params = layer.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> jax.tree_util.tree_map(jnp.shape, params)
      {'params': {'bias': (4,), 'kernel': (3, 4)}}

    The kernels run when the computation dtype is float32 or bfloat16, ``dot_general`` and
    ``dot_general_cls`` are None, and ``promote_dtype`` is Flax's own or returns arrays of
    one of those dtypes. Otherwise the call computes as ``flax.linen.Dense`` does (followed
    by the activation).

    Attributes:
      features: the number of output features.
      use_bias: whether to add a bias to the output (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
        bfloat16 computes with float32 accumulation, bias and activation.
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: numerical precision of the computation, see ``jax.lax.Precision``. On the
        kernels every precision is the same: products in the computation dtype, float32
        accumulation (what XLA's CPU dot does for every precision, too).
      kernel_init: initializer function for the weight matrix.
      bias_init: initializer function for the bias.
      promote_dtype: function to promote the dtype of the arrays to the desired dtype, as
        in ``flax.linen.Dense``: called as ``promote_dtype(inputs, kernel, bias,
        dtype=dtype)``, returns the three arrays.
      dot_general: a custom ``lax.dot_general``; given, the layer computes as
        ``flax.linen.Dense`` with it (not on the kernels).
      dot_general_cls: a class whose instances are a custom ``dot_general``; as above.
      activation: ``None``, ``"relu"``, ``"gelu"`` (tanh approximation, as
        ``flax.linen.gelu``), ``"sigmoid"`` or ``"tanh"``, applied in the kernel while the
        output is in registers (default: None).
    """

    features: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = initializers.zeros_init()
    promote_dtype: PromoteDtypeFn = promote_dtype
    dot_general: DotGeneralT | None = None
    dot_general_cls: Any = None
    activation: str | None = None

    @compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the layer to the last dimension of ``inputs``.

        Args:
          inputs: the nd-array to be transformed.

        Returns:
          The transformed input, in the computation dtype.
        """
        check.activation(self.activation, "jb.nn.Dense")
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

        y, _ = dense_on_kernels(self, inputs, kernel, bias, self.activation)
        if y is not None:
            return y

        # flax.linen.Dense's computation, for what the kernels cannot run.
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if self.dot_general_cls is not None:
            dot_general = self.dot_general_cls()
        elif self.dot_general is not None:
            dot_general = self.dot_general
        else:
            dot_general = lax.dot_general
        y = dot_general(
            inputs,
            kernel,
            (((inputs.ndim - 1,), (0,)), ((), ())),
            precision=self.precision,
        )
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return _activations.apply(self.activation, y)


# --- Conv ----------------------------------------------------------------------------------
# The geometry, shared by the module's stock path and conv_on_kernels.


def _kernel_size(layer) -> tuple[int, ...]:
    """The kernel's spatial size; an int is a 1-D kernel (as in Flax)."""
    return (layer.kernel_size,) if isinstance(layer.kernel_size, int) else tuple(layer.kernel_size)


def _pad_by_mode(inputs, padding, kernel_size, kernel_dilation):
    """``(inputs, padding)`` with Flax's ``'CIRCULAR'``, ``'REFLECT'`` and ``'CAUSAL'`` (1-D)
    paddings applied to the inputs, as Flax does, leaving ``'VALID'``; others unchanged."""
    if padding in ('CIRCULAR', 'REFLECT'):
        dilated = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation, strict=True)]
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
        mode = {'CIRCULAR': 'wrap', 'REFLECT': 'reflect'}[padding]
        return jnp.pad(inputs, pads, mode=mode), 'VALID'
    if padding == 'CAUSAL':
        pad = kernel_dilation[0] * (kernel_size[0] - 1)
        return jnp.pad(inputs, [(0, 0), (pad, 0), (0, 0)]), 'VALID'
    return inputs, padding


def _crop_negative_padding(inputs, padding, rank: int):
    """``(inputs, padding)`` with the negative pads sliced off the spatial dims of
    ``inputs`` (N, spatial..., C) and the pads clamped at 0, or None when that leaves no
    pixels. Stock XLA's own cropping convolution reads garbage now and then."""
    padding = [tuple(p) for p in padding]
    if all(v >= 0 for p in padding for v in p):
        return inputs, padding
    pairs = list(zip(inputs.shape[1:1 + rank], padding, strict=True))
    if any(n + min(lo, 0) + min(hi, 0) < 1 for n, (lo, hi) in pairs):
        return None
    inputs = inputs[(slice(None),) + tuple(slice(-min(lo, 0), n + min(hi, 0)) for n, (lo, hi) in pairs)]
    return inputs, [(max(lo, 0), max(hi, 0)) for lo, hi in padding]


def _channels_last(ndim: int) -> lax.ConvDimensionNumbers:
    """Flax's convolution layout for inputs of rank ``ndim``: (N, spatial..., C) inputs and
    outputs, (spatial..., C, K) kernels."""
    lhs = (0, ndim - 1) + tuple(range(1, ndim - 1))
    rhs = (ndim - 1, ndim - 2) + tuple(range(0, ndim - 2))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)


class Conv(Module):
    """A convolution (channels last) with an optional fused activation, on jax_brgemm's
    convolution kernels.

    A drop-in for ``flax.linen.Conv``: the same fields in the same order, the same
    parameters (names, shapes, initializers, dtypes), the same results; ``activation``
    comes after the stock fields::

      >>> import jax, jax.numpy as jnp
      >>> import jax_brgemm as jb
      >>> layer = jb.nn.Conv(features=4, kernel_size=(3, 3), activation="relu")
      >>> params = layer.init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
      >>> jax.tree_util.tree_map(jnp.shape, params)
      {'params': {'bias': (4,), 'kernel': (3, 3, 3, 4)}}

    The kernels run 1-D and 2-D convolutions without dilation or feature groups, with
    every Flax padding form (``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``,
    ``'CAUSAL'`` for 1-D, ints and ``(low, high)`` pairs; a negative pad crops), a float32 or
    bfloat16 computation, Flax's ``promote_dtype`` (or one returning arrays of those
    dtypes) and no custom ``conv_general_dilated``. Anything else computes as
    ``flax.linen.Conv`` does (followed by the activation).

    Attributes:
      features: number of convolution filters.
      kernel_size: shape of the convolutional kernel; an int is a 1-D kernel (as in Flax).
      strides: an int or a sequence of ints, the inter-window strides (default: 1).
      padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'`` (1-D),
        an int, or a sequence of ints / ``(low, high)`` pairs, one per spatial dim.
      input_dilation: an int or a sequence of ints (default: 1).
      kernel_dilation: an int or a sequence of ints (default: 1).
      feature_group_count: divides the input features into groups (default: 1).
      use_bias: whether to add a bias to the output (default: True).
      mask: optional mask for the weights, of the kernel's shape.
      dtype: the dtype of the computation (default: infer from input and params).
        bfloat16 computes with float32 accumulation, bias and activation.
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: numerical precision of the stock computation; on the kernels products are
        in the computation dtype with float32 accumulation.
      kernel_init: initializer for the convolutional kernel.
      bias_init: initializer for the bias.
      promote_dtype: as in ``flax.linen.Conv``.
      conv_general_dilated: a custom ``lax.conv_general_dilated``; given, the layer computes
        as ``flax.linen.Conv`` with it (not on the kernels).
      conv_general_dilated_cls: a class whose instances are one; as above.
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
    promote_dtype: PromoteDtypeFn = promote_dtype
    conv_general_dilated: Any = None
    conv_general_dilated_cls: Any = None
    activation: str | None = None

    @compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the convolution to ``inputs`` of shape ``(*batch_dims, spatial...,
        features)``: several batch dims are flattened and restored, a missing one is added
        and removed (as in Flax).

        Returns:
          The convolved data, in the computation dtype.
        """
        op = "jb.nn.Conv"
        check.activation(self.activation, op)
        kernel_size = _kernel_size(self)
        rank = len(kernel_size)
        inputs = raw_inputs = jnp.asarray(inputs)
        batch_dims = inputs.ndim - (rank + 1)
        if batch_dims < 0:
            raise ValueError(f"{op}: a {rank}-D convolution needs inputs of rank >= {rank + 1} "
                             f"(spatial dims and features), got shape {inputs.shape}")
        batch_shape = inputs.shape[:batch_dims]
        if batch_dims != 1:
            inputs = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
        strides, input_dilation, kernel_dilation = (
            _adapt.per_dim(v, rank) for v in (self.strides, self.input_dilation, self.kernel_dilation))

        padding = canonicalize_padding(self.padding, rank)
        if padding == 'CAUSAL' and rank != 1:
            raise ValueError('Causal padding is only implemented for 1D convolutions.')
        inputs, padding = _pad_by_mode(inputs, padding, kernel_size, kernel_dilation)

        in_features = jnp.shape(inputs)[-1]
        if in_features % self.feature_group_count:
            raise ValueError(f"{op}: {in_features} input features do not divide into "
                             f"feature_group_count={self.feature_group_count} groups")
        kernel_shape = kernel_size + (in_features // self.feature_group_count, self.features)
        if self.mask is not None and self.mask.shape != kernel_shape:
            raise ValueError('Mask needs to have the same shape as weights. '
                             f'Shapes are: {self.mask.shape}, {kernel_shape}')
        kernel = raw_kernel = self.param('kernel', self.kernel_init, kernel_shape, self.param_dtype)
        if self.mask is not None:
            kernel *= self.mask
        bias = (self.param('bias', self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)

        # the kernels take the unpadded, unflattened inputs and the unmasked kernel
        y, _ = conv_on_kernels(self, raw_inputs, raw_kernel, bias, self.activation)
        if y is not None:
            return y
        # flax.linen.Conv's computation, for what the kernels cannot run; negative pads
        # (without input dilation, which they would apply to) as crops, as on the kernels
        if not isinstance(padding, str) and all(d == 1 for d in input_dilation):
            inputs, padding = _crop_negative_padding(inputs, padding, rank) or (inputs, padding)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if self.conv_general_dilated_cls is not None:
            conv = self.conv_general_dilated_cls()
        else:
            conv = self.conv_general_dilated or lax.conv_general_dilated
        y = conv(inputs, kernel, strides, padding, lhs_dilation=input_dilation,
                 rhs_dilation=kernel_dilation, dimension_numbers=_channels_last(inputs.ndim),
                 feature_group_count=self.feature_group_count, precision=self.precision)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        y = _activations.apply(self.activation, y)
        if batch_dims != 1:
            y = jnp.reshape(y, batch_shape + y.shape[1:])
        return y


def conv_on_kernels(layer, inputs, kernel, bias, activation=None):
    """A Conv ``layer``'s result on the kernels, as a ``Decision``.

    ``layer`` has ``flax.linen.Conv``'s fields (``kernel_size``, ``strides``, ``padding``,
    dilations, ``feature_group_count``, ``mask``, ``dtype``, ``promote_dtype``,
    ``conv_general_dilated(_cls)``) or ``flax.nnx.Conv``'s: a stock module or a jax_brgemm
    one. ``inputs`` are the layer's call argument, ``kernel`` and ``bias`` its parameters
    (the kernel not yet masked); the result is what the layer returns (batch dims
    restored), with ``activation`` fused.
    """
    kernel_size = _kernel_size(layer)
    rank = len(kernel_size)
    if rank not in (1, 2):
        return Decision.stock(f"{rank}-D convolution")
    if layer.feature_group_count != 1:
        return Decision.stock("feature groups")
    if _adapt.custom_conv(layer):
        return Decision.stock("custom conv_general_dilated")
    strides, input_dilation, kernel_dilation = (
        _adapt.per_dim(v, rank) for v in (layer.strides, layer.input_dilation, layer.kernel_dilation))
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in strides):
        return Decision.stock("non-integer strides")  # the stock code raises lax's TypeError
    if any(d != 1 for d in input_dilation):
        return Decision.stock("input dilation")
    if any(d != 1 for d in kernel_dilation):
        return Decision.stock("kernel dilation")
    inputs = jnp.asarray(inputs)
    batch_dims = inputs.ndim - (rank + 1)
    features = _adapt.out_features(layer)
    if batch_dims < 0 or jnp.shape(kernel) != kernel_size + (inputs.shape[-1], features):
        return Decision.stock("unexpected shapes")
    batch_shape = inputs.shape[:batch_dims]
    if batch_dims != 1:
        inputs = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
    try:
        padding = canonicalize_padding(layer.padding, rank)
    except (TypeError, ValueError) as e:
        return Decision.stock(f"padding ({e})")
    if padding == 'CAUSAL' and rank != 1:
        return Decision.stock("causal padding of a 2-D convolution")
    inputs, padding = _pad_by_mode(inputs, padding, kernel_size, kernel_dilation)
    if not isinstance(padding, str):
        cropped = _crop_negative_padding(inputs, padding, rank)
        if cropped is None:
            return Decision.stock("padding crops the whole input")
        inputs, padding = cropped
    elif padding.upper() not in ('SAME', 'VALID', 'SAME_LOWER'):
        return Decision.stock(f"padding {padding!r}")
    if layer.mask is not None:
        if jnp.shape(layer.mask) != jnp.shape(kernel):
            return Decision.stock("mask shape")
        kernel = kernel * layer.mask
    operands, why = _adapt.kernel_operands(layer, inputs, kernel, bias)
    if operands is None:
        return Decision.stock(why)
    inputs, kernel, bias, dtype = operands
    if rank == 1:  # a 1-D convolution is a 2-D one over a single row
        if not isinstance(padding, str):
            padding = [(0, 0)] + padding
        y = conv2d(inputs[:, None], kernel[None], bias, strides=(1,) + strides, padding=padding,
                   activation=activation, dtype=dtype)[:, 0]
    else:
        y = conv2d(inputs, kernel, bias, strides=strides, padding=padding, activation=activation,
                   dtype=dtype)
    if batch_dims != 1:
        y = jnp.reshape(y, batch_shape + y.shape[1:])
    return Decision(y)
