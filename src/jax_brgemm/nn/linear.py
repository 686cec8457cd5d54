"""``Dense`` and ``Conv``: ``flax.linen``'s linear layers on the fully-connected and
convolution kernels, and the functions that run a stock layer's call on them (for
``accelerate()``)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding
from flax.typing import Array

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
    precision = getattr(layer, "precision", None)
    why = _adapt.precision_why(precision)
    if why:
        return Decision.stock(why)
    operands = _adapt.kernel_operands(layer, inputs, kernel, bias)
    if not operands.taken:
        return operands
    inputs, kernel, bias, dtype = operands.value
    why = stays_stock(dtype, int(np.prod(inputs.shape[:-1]))) if stays_stock else ""
    if why:
        return Decision.stock(why)
    return Decision(dense(inputs, kernel, bias, activation=activation, dtype=dtype, precision=precision))


class Dense(nn.Dense):
    """A linear transformation applied over the last dimension of the input, with an
    optional fused activation, on jax_brgemm's fully-connected kernels.

    A drop-in for ``flax.linen.Dense`` (a subclass of it): the same fields in the same order
    (so positional construction such as ``Dense(4, True, jnp.bfloat16)`` means what it means
    there), the same parameters, the same results; ``activation`` comes after the stock
    fields::

      >>> import jax, jax.numpy as jnp
      >>> import jax_brgemm as jb
      >>> layer = jb.nn.Dense(features=4, activation="relu")
      >>> params = layer.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> jax.tree_util.tree_map(jnp.shape, params)
      {'params': {'bias': (4,), 'kernel': (3, 4)}}

    ``init`` is flax's own call (it creates the parameters), followed by the activation. A
    call on existing parameters runs on the kernels when the computation dtype is float32 or
    bfloat16, ``dot_general`` and ``dot_general_cls`` are None, and ``promote_dtype`` is
    Flax's own or returns arrays of one of those dtypes; otherwise it is flax's call too.

    Attributes:
      features, use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
        promote_dtype, dot_general, dot_general_cls: as in ``flax.linen.Dense``. A bfloat16
        ``dtype`` computes with float32 accumulation, bias and activation; on the kernels
        every ``precision`` is the same (products in the computation dtype, float32
        accumulation, what XLA's CPU dot does for every precision, too).
      activation: ``None``, ``"relu"``, ``"gelu"`` (tanh approximation, as
        ``flax.linen.gelu``), ``"sigmoid"`` or ``"tanh"``, applied in the kernel while the
        output is in registers (default: None).
    """

    activation: str | None = None

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the layer to the last dimension of ``inputs``; the result is in the
        computation dtype."""
        check.activation(self.activation, "jb.nn.Dense")
        params = _existing_params(self, (jnp.shape(inputs)[-1], self.features))
        if params is not None:
            y, why = dense_on_kernels(self, inputs, *params, self.activation)
            if not why:
                return y
        return _activations.apply(self.activation, super().__call__(inputs))


def _existing_params(layer, kernel_shape):
    """``(kernel, bias)`` (bias None without ``use_bias``): the parameters a Dense or Conv
    ``layer``'s stock call would read, with the shapes it would check; None while
    initializing or when they are missing or misshapen (flax's call then creates them, or
    raises its error). Read, not declared: flax's call may still declare them."""
    if layer.is_initializing() or not layer.has_variable("params", "kernel") or (
            layer.use_bias and not layer.has_variable("params", "bias")):
        return None
    kernel = nn.unbox(layer.get_variable("params", "kernel"))
    bias = nn.unbox(layer.get_variable("params", "bias")) if layer.use_bias else None
    if jnp.shape(kernel) != tuple(kernel_shape) or (
            bias is not None and jnp.shape(bias) != (layer.features,)):
        return None
    return kernel, bias


# --- Conv ----------------------------------------------------------------------------------
# The geometry conv_on_kernels applies before the kernels (the module's crop, too).


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
    ``inputs`` (..., spatial..., C) and the pads clamped at 0, or None when that leaves no
    pixels. Stock XLA's own cropping convolution reads garbage now and then."""
    padding = [tuple(p) for p in padding]
    if all(v >= 0 for p in padding for v in p):
        return inputs, padding
    pairs = list(zip(inputs.shape[-rank - 1:-1], padding, strict=True))
    if any(n + min(lo, 0) + min(hi, 0) < 1 for n, (lo, hi) in pairs):
        return None
    window = tuple(slice(-min(lo, 0), n + min(hi, 0)) for n, (lo, hi) in pairs)
    inputs = inputs[(Ellipsis,) + window + (slice(None),)]
    return inputs, [(max(lo, 0), max(hi, 0)) for lo, hi in padding]


class Conv(nn.Conv):
    """A convolution (channels last) with an optional fused activation, on jax_brgemm's
    convolution kernels.

    A drop-in for ``flax.linen.Conv`` (a subclass of it): the same fields in the same order,
    the same parameters (names, shapes, initializers, dtypes), the same results;
    ``activation`` comes after the stock fields::

      >>> import jax, jax.numpy as jnp
      >>> import jax_brgemm as jb
      >>> layer = jb.nn.Conv(features=4, kernel_size=(3, 3), activation="relu")
      >>> params = layer.init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
      >>> jax.tree_util.tree_map(jnp.shape, params)
      {'params': {'bias': (4,), 'kernel': (3, 3, 3, 4)}}

    ``init`` is flax's own call (it creates the parameters), followed by the activation. A
    call on existing parameters runs on the kernels for 1-D and 2-D convolutions (kernel
    dilation, feature groups, input dilation without strides included), with every Flax
    padding form (``'SAME'``, ``'VALID'``,
    ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'`` for 1-D, ints and ``(low, high)`` pairs; a
    negative pad crops), a float32 or bfloat16 computation, Flax's ``promote_dtype`` (or
    one returning arrays of those dtypes) and no custom ``conv_general_dilated``. Anything
    else is flax's call, followed by the activation; negative pads (without input dilation)
    crop the input first there too, as on the kernels, since XLA's own cropping
    convolution reads garbage now and then.

    Attributes:
      features, kernel_size, strides, padding, input_dilation, kernel_dilation,
        feature_group_count, use_bias, mask, dtype, param_dtype, precision, kernel_init,
        bias_init, promote_dtype, conv_general_dilated, conv_general_dilated_cls: as in
        ``flax.linen.Conv``. A bfloat16 ``dtype`` computes with float32 accumulation, bias
        and activation; ``precision`` only affects flax's call (on the kernels products are
        in the computation dtype with float32 accumulation).
      activation: ``None``, ``"relu"``, ``"gelu"``, ``"sigmoid"`` or ``"tanh"``, applied in
        the kernel while the output is in registers (default: None).
    """

    activation: str | None = None

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the convolution to ``inputs`` of shape ``(*batch_dims, spatial...,
        features)``: several batch dims are flattened and restored, a missing one is added
        and removed (as in Flax). The result is in the computation dtype."""
        op = "jb.nn.Conv"
        check.activation(self.activation, op)
        inputs = jnp.asarray(inputs)
        kernel_size = _kernel_size(self)
        rank = len(kernel_size)
        if inputs.ndim < rank + 1:
            raise ValueError(f"{op}: a {rank}-D convolution needs inputs of rank >= {rank + 1} "
                             f"(spatial dims and features), got shape {inputs.shape}")
        in_features = inputs.shape[-1]
        if in_features % self.feature_group_count:
            raise ValueError(f"{op}: {in_features} input features do not divide into "
                             f"feature_group_count={self.feature_group_count} groups")
        params = _existing_params(
            self, kernel_size + (in_features // self.feature_group_count, self.features))
        if params is not None:
            y, why = conv_on_kernels(self, inputs, *params, self.activation)
            if not why:
                return y
        cropped = _cropped_by_negative_padding(self, inputs, rank)
        if cropped is not None:
            # flax's call of this layer with the pads left after the crop, in this scope
            inputs, padding = cropped
            view = self.clone(padding=padding, parent=self.scope)
            return _activations.apply(self.activation, nn.Conv.__call__(view, inputs))
        return _activations.apply(self.activation, super().__call__(inputs))


def _cropped_by_negative_padding(layer, inputs, rank: int):
    """``(inputs, padding)``: the inputs of a Conv ``layer`` whose explicit padding has a
    negative pad, cropped by it, and the pads left (clamped at 0); None when there is nothing
    to crop (or the crop would leave nothing, or input dilation, to which pads apply)."""
    try:
        padding = canonicalize_padding(layer.padding, rank)
    except (TypeError, ValueError):  # flax's call raises it
        return None
    if (isinstance(padding, str) or all(v >= 0 for pair in padding for v in pair)
            or any(d != 1 for d in _adapt.per_dim(layer.input_dilation, rank))):
        return None
    return _crop_negative_padding(inputs, padding, rank)


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
    if _adapt.custom_conv(layer):
        return Decision.stock("custom conv_general_dilated")
    strides, input_dilation, kernel_dilation = (
        _adapt.per_dim(v, rank) for v in (layer.strides, layer.input_dilation, layer.kernel_dilation))
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in strides):
        return Decision.stock("non-integer strides")  # the stock code raises lax's TypeError
    dilated_input = any(d != 1 for d in input_dilation)
    if dilated_input and any(v != 1 for v in strides):
        return Decision.stock("input dilation with strides")
    inputs = jnp.asarray(inputs)
    batch_dims = inputs.ndim - (rank + 1)
    features = _adapt.out_features(layer)
    groups = layer.feature_group_count
    if (batch_dims < 0 or not isinstance(groups, (int, np.integer)) or groups < 1
            or inputs.shape[-1] % groups or features % groups):
        return Decision.stock("unexpected shapes")  # the stock call raises its error
    if jnp.shape(kernel) != kernel_size + (inputs.shape[-1] // groups, features):
        return Decision.stock("unexpected shapes")
    batch_shape = inputs.shape[:batch_dims]
    if batch_dims != 1:
        inputs = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
    try:
        padding = canonicalize_padding(layer.padding, rank)
    except (TypeError, ValueError) as e:
        return Decision.stock(f"padding ({e})")
    if dilated_input and (isinstance(padding, str) or any(v < 0 for pair in padding for v in pair)):
        # lax refuses string pads there; negative ones crop the dilated input, not the input
        return Decision.stock("input dilation with string or negative padding")
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
                   activation=activation, dtype=dtype, rhs_dilation=(1,) + kernel_dilation,
                   lhs_dilation=(1,) + input_dilation, feature_group_count=groups)[:, 0]
    else:
        y = conv2d(inputs, kernel, bias, strides=strides, padding=padding, activation=activation,
                   dtype=dtype, rhs_dilation=kernel_dilation, lhs_dilation=input_dilation,
                   feature_group_count=groups)
    if batch_dims != 1:
        y = jnp.reshape(y, batch_shape + y.shape[1:])
    return Decision(y)
