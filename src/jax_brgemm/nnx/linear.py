"""``jb.nnx.Linear``, ``Conv`` and ``ConvTranspose``: ``flax.nnx``'s on the BRGEMM kernels,
with the stock modules' constructors, state and results."""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn import linear as stock_linear
from flax.nnx.nn.linear import canonicalize_padding, default_bias_init, default_kernel_init
from flax.typing import (ConvGeneralDilatedT, DotGeneralT, Dtype, Initializer, PaddingLike,
                         PrecisionLike, PromoteDtypeFn)
from jax import lax

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm.nn import _adapt
from jax_brgemm.nn.conv import conv_on_kernels, conv_transpose_on_kernels
from jax_brgemm.nn.linear import dense_on_kernels

Array = tp.Any

#: The padding strings the stock layer accepts (lax's and Flax's own).
_PADDING_NAMES = ('SAME', 'SAME_LOWER', 'VALID', 'CIRCULAR', 'REFLECT', 'CAUSAL')


def kernel_and_bias(layer) -> tuple[Array, Array | None]:
    """An NNX Linear / Conv layer's parameters as arrays (the bias None without one)."""
    return layer.kernel[...], (layer.bias[...] if layer.bias is not None else None)


def _positive_int(op: str, **values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{op}: {name} must be an int, got {v!r}")
    check.positive(op, **{name: int(v) for name, v in values.items()})


class Linear(stock_linear.Linear):
    """A linear transformation over the last dimension of the input, with an optional fused
    activation, on jax_brgemm's fully-connected kernels.

    A drop-in for ``flax.nnx.Linear`` (a subclass of it): the same constructor, the same
    ``nnx.Param`` state from the same ``rngs`` (so ``nnx.state`` trees and checkpoints
    interchange), the same results; ``activation`` comes after the stock arguments::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import jax_brgemm.nnx
      >>> layer = jax_brgemm.nnx.Linear(3, 4, rngs=nnx.Rngs(0), activation="relu")
      >>> layer(jnp.ones((2, 3))).shape
      (2, 4)

    The kernels run when the computation dtype is float32 or bfloat16, ``dot_general`` is
    ``lax.dot_general``, ``promote_dtype`` is Flax's own or returns arrays of one of those
    dtypes, ``preferred_element_type`` is None or the computation dtype (or float32 over
    bfloat16), and the call has no ``out_sharding``. Anything else computes as
    ``flax.nnx.Linear`` does, followed by the activation. ``precision`` only affects that
    stock computation: on the kernels products are in the computation dtype with float32
    accumulation, as XLA's CPU dot does for every precision.

    Args:
      in_features, out_features, use_bias, dtype, param_dtype, precision, kernel_init,
        bias_init, dot_general, promote_dtype, preferred_element_type, rngs,
        kernel_metadata, bias_metadata: as ``flax.nnx.Linear``'s.
      activation: ``None``, ``"relu"``, ``"gelu"`` (tanh approximation), ``"sigmoid"`` or
        ``"tanh"``, applied in the kernel while the output is in registers.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        dot_general: DotGeneralT = lax.dot_general,
        promote_dtype: PromoteDtypeFn = nnx_dtypes.promote_dtype,
        preferred_element_type: Dtype | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        activation: str | None = None,
    ):
        op = "jb.nnx.Linear"
        _positive_int(op, in_features=in_features, out_features=out_features)
        check.activation(activation, op)
        super().__init__(
            in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
            precision=precision, kernel_init=kernel_init, bias_init=bias_init,
            dot_general=dot_general, promote_dtype=promote_dtype,
            preferred_element_type=preferred_element_type, rngs=rngs,
            kernel_metadata=kernel_metadata, bias_metadata=bias_metadata)
        self.activation = activation

    def __call__(self, inputs: Array, out_sharding=None) -> Array:
        """Applies the layer to the last dimension of ``inputs``: ``(..., in_features)`` to
        ``(..., out_features)``, in the computation dtype."""
        inputs = jnp.asarray(inputs)
        if inputs.ndim < 1 or inputs.shape[-1] != self.in_features:
            raise ValueError(f"jb.nnx.Linear: inputs must be (..., in_features = "
                             f"{self.in_features}), got shape {inputs.shape}")
        if out_sharding is None:
            y, _ = dense_on_kernels(self, inputs, *kernel_and_bias(self), self.activation)
            if y is not None:
                return y
        return _activations.apply(self.activation, super().__call__(inputs, out_sharding))


class Conv(stock_linear.Conv):
    """A convolution (channels last) with an optional fused activation, on jax_brgemm's
    convolution kernels.

    A drop-in for ``flax.nnx.Conv`` (a subclass of it): the same constructor, the same
    ``nnx.Param`` state from the same ``rngs``, the same results; ``activation`` comes after
    the stock arguments::

      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jax_brgemm.nnx
      >>> layer = jax_brgemm.nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0), activation="relu")
      >>> layer(jnp.ones((1, 8, 8, 3))).shape
      (1, 8, 8, 4)

    The kernels run 1-D, 2-D and 3-D convolutions (kernel and input dilations, feature
    groups: grouped and depthwise), with every padding form (``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'`` for
    1-D, ints and ``(low, high)`` pairs; a negative pad crops), strides and masks, a float32
    or bfloat16 computation, ``conv_general_dilated`` left at ``lax.conv_general_dilated``
    and no ``out_sharding``; ``promote_dtype`` and ``preferred_element_type`` as for
    ``Linear``. Anything else (float16, a custom ``conv_general_dilated`` ...) computes as
    ``flax.nnx.Conv`` does, followed by the activation.

    Args:
      in_features, out_features, kernel_size, strides, padding, input_dilation,
        kernel_dilation, feature_group_count, use_bias, mask, dtype, param_dtype,
        precision, kernel_init, bias_init, conv_general_dilated, promote_dtype,
        preferred_element_type, rngs, kernel_metadata, bias_metadata: as
        ``flax.nnx.Conv``'s.
      activation: ``None``, ``"relu"``, ``"gelu"``, ``"sigmoid"`` or ``"tanh"``, fused.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | tp.Sequence[int],
        strides: None | int | tp.Sequence[int] = 1,
        *,
        padding: PaddingLike = 'SAME',
        input_dilation: None | int | tp.Sequence[int] = 1,
        kernel_dilation: None | int | tp.Sequence[int] = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        mask: Array | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        conv_general_dilated: ConvGeneralDilatedT = lax.conv_general_dilated,
        promote_dtype: PromoteDtypeFn = nnx_dtypes.promote_dtype,
        preferred_element_type: Dtype | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        activation: str | None = None,
    ):
        op = "jb.nnx.Conv"
        _positive_int(op, in_features=in_features, out_features=out_features,
                      feature_group_count=feature_group_count)
        sizes = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
        if not sizes:
            raise ValueError(f"{op}: kernel_size must be an int or a non-empty sequence of ints, "
                             f"got {kernel_size!r}")
        _positive_int(op, **{f"kernel_size[{i}]": k for i, k in enumerate(sizes)})
        for name, value in (("strides", strides), ("input_dilation", input_dilation),
                            ("kernel_dilation", kernel_dilation)):
            values = _adapt.per_dim(value, len(sizes))
            if len(values) != len(sizes):
                raise ValueError(f"{op}: {name} must be an int or {len(sizes)} ints (one per "
                                 f"spatial dim of kernel_size {sizes}), got {value!r}")
            _positive_int(op, **{f"{name}[{i}]": v for i, v in enumerate(values)})
        if in_features % feature_group_count:
            raise ValueError(f"{op}: in_features={in_features} does not divide into "
                             f"feature_group_count={feature_group_count} groups")
        try:
            canonical = canonicalize_padding(padding, len(sizes))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{op}: padding: {e}") from None
        if isinstance(canonical, str) and canonical.upper() not in _PADDING_NAMES:
            raise ValueError(f"{op}: padding {padding!r} is not one of {_PADDING_NAMES}, an int "
                             f"or a sequence of ints / (low, high) pairs")
        if canonical == 'CAUSAL' and len(sizes) != 1:
            raise ValueError(f"{op}: padding 'CAUSAL' is only for 1-D convolutions, got "
                             f"kernel_size {sizes}")
        check.activation(activation, op)
        super().__init__(
            in_features, out_features, kernel_size, strides, padding=padding,
            input_dilation=input_dilation, kernel_dilation=kernel_dilation,
            feature_group_count=feature_group_count, use_bias=use_bias, mask=mask, dtype=dtype,
            param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
            bias_init=bias_init, conv_general_dilated=conv_general_dilated,
            promote_dtype=promote_dtype, preferred_element_type=preferred_element_type,
            rngs=rngs, kernel_metadata=kernel_metadata, bias_metadata=bias_metadata)
        self.activation = activation

    def __call__(self, inputs: Array, out_sharding=None) -> Array:
        """Convolves ``inputs`` of shape ``(*batch_dims, spatial..., in_features)``: several
        batch dims are flattened and restored, a missing one is added and removed (as in
        Flax). Returns the result in the computation dtype."""
        inputs = jnp.asarray(inputs)
        rank = len(self.kernel_size)
        if inputs.ndim < rank + 1 or inputs.shape[-1] != self.in_features:
            raise ValueError(f"jb.nnx.Conv: inputs must be (*batch, {rank} spatial dims, "
                             f"in_features = {self.in_features}), got shape {inputs.shape}")
        if out_sharding is None:
            y, _ = conv_on_kernels(self, inputs, *kernel_and_bias(self), self.activation)
            if y is not None:
                return y
        return _activations.apply(self.activation, super().__call__(inputs, out_sharding))


class ConvTranspose(stock_linear.ConvTranspose):
    """A transposed convolution (channels last) with an optional fused activation, on
    jax_brgemm's convolution kernels.

    A drop-in for ``flax.nnx.ConvTranspose`` (a subclass of it): the same constructor, the
    same ``nnx.Param`` state from the same ``rngs``, the same results; ``activation`` comes
    after the stock arguments::

      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jax_brgemm.nnx
      >>> layer = jax_brgemm.nnx.ConvTranspose(3, 4, (3, 3), strides=2, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((1, 8, 8, 3))).shape
      (1, 16, 16, 4)

    The kernels run what ``jb.nn.ConvTranspose`` runs there (1-D, 2-D, 3-D; strides, kernel
    dilation, ``transpose_kernel``, masks, ``'SAME'``, ``'VALID'``, ``'CIRCULAR'`` and
    explicit pads), with ``Conv``'s dtype rules; anything else computes as
    ``flax.nnx.ConvTranspose`` does, followed by the activation.

    Args:
      in_features, out_features, kernel_size, strides, padding, kernel_dilation, use_bias,
        mask, dtype, param_dtype, precision, kernel_init, bias_init, transpose_kernel,
        promote_dtype, preferred_element_type, rngs, kernel_metadata, bias_metadata: as
        ``flax.nnx.ConvTranspose``'s.
      activation: ``None``, ``"relu"``, ``"gelu"``, ``"sigmoid"`` or ``"tanh"``, fused.
    """

    def __init__(self, in_features: int, out_features: int, kernel_size: int | tp.Sequence[int],
                 strides: None | int | tp.Sequence[int] = None, *, activation: str | None = None,
                 rngs: nnx.Rngs, **stock_arguments):
        op = "jb.nnx.ConvTranspose"
        _positive_int(op, in_features=in_features, out_features=out_features)
        check.activation(activation, op)
        super().__init__(in_features, out_features, kernel_size, strides, rngs=rngs, **stock_arguments)
        self.activation = activation

    def __call__(self, inputs: Array) -> Array:
        """Applies the transposed convolution to ``inputs`` of shape ``(*batch_dims,
        spatial..., in_features)``, as Flax does. Returns the result in the computation
        dtype."""
        inputs = jnp.asarray(inputs)
        rank = len(self.kernel_size)
        if inputs.ndim < rank + 1 or inputs.shape[-1] != self.in_features:
            raise ValueError(f"jb.nnx.ConvTranspose: inputs must be (*batch, {rank} spatial dims, "
                             f"in_features = {self.in_features}), got shape {inputs.shape}")
        y, _ = conv_transpose_on_kernels(self, inputs, *kernel_and_bias(self), self.activation)
        if y is not None:
            return y
        return _activations.apply(self.activation, super().__call__(inputs))
