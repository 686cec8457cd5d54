"""``Conv`` and ``ConvTranspose``: ``flax.linen``'s convolutions on the convolution kernels,
and the functions that run a stock layer's call on them (for ``accelerate()`` and the NNX
modules).

Every convolution Flax writes is one ``conv_general_dilated`` with some geometry; here each
is one call of ``jb.conv2d`` (1-D as a single row, 2-D) or ``jb.conv3d``: dense, grouped,
depthwise, kernel- and input-dilated, and transposed (``ConvTranspose`` is the
input-dilated convolution ``lax.conv_transpose`` computes).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding
from flax.typing import Array
from jax import lax

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm.nn import _adapt
from jax_brgemm.nn._adapt import Decision
from jax_brgemm.nn.linear import existing_params
from jax_brgemm.ops.conv import conv2d
from jax_brgemm.ops.conv3d import conv3d

__all__ = ["Conv", "ConvTranspose", "conv_on_kernels", "conv_transpose_on_kernels"]


def conv_on_kernels(layer, inputs, kernel, bias, activation=None):
    """A Conv ``layer``'s result on the kernels, as a ``Decision``.

    ``layer`` has ``flax.linen.Conv``'s fields (``kernel_size``, ``strides``, ``padding``,
    dilations, ``feature_group_count``, ``mask``, ``dtype``, ``promote_dtype``, ``precision``,
    ``conv_general_dilated(_cls)``) or ``flax.nnx.Conv``'s: a stock module or a jax_brgemm
    one. ``inputs`` are the layer's call argument, ``kernel`` and ``bias`` its parameters
    (the kernel not yet masked); the result is what the layer returns (batch dims
    restored), with ``activation`` fused.
    """
    kernel_size = _kernel_size(layer)
    rank = len(kernel_size)
    if _adapt.custom_conv(layer):
        return Decision.stock("custom conv_general_dilated")
    geometry = _geometry(layer, rank)
    if not geometry.taken:
        return geometry
    strides, input_dilation, kernel_dilation = geometry.value
    groups = layer.feature_group_count
    if not isinstance(groups, (int, np.integer)) or groups < 1 or jnp.shape(inputs)[-1] % groups:
        return Decision.stock("unexpected shapes")  # the stock call raises its error
    expected = kernel_size + (jnp.shape(inputs)[-1] // groups, _adapt.out_features(layer))
    try:
        padding = canonicalize_padding(layer.padding, rank)
    except (TypeError, ValueError) as e:
        return Decision.stock(f"padding ({e})")
    if padding == 'CAUSAL' and rank != 1:
        return Decision.stock(f"causal padding of a {rank}-D convolution")
    if max(input_dilation) > 1 and isinstance(padding, str):
        return Decision.stock("input dilation with string padding")  # lax raises its error
    dilated_kernel = tuple((k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation, strict=True))
    return _run_conv(layer, inputs, kernel, bias, expected, activation, dict(
        padding=padding, strides=strides, rhs_dilation=kernel_dilation,
        lhs_dilation=input_dilation, feature_group_count=groups), dilated_kernel)


def conv_transpose_on_kernels(layer, inputs, kernel, bias, activation=None):
    """A ConvTranspose ``layer``'s result on the kernels, as a ``Decision``: the
    input-dilated convolution ``lax.conv_transpose`` computes (input dilation = the strides,
    pads from the forward convolution's padding name), ``transpose_kernel``'s flip and
    channel swap, Flax's ``'CIRCULAR'`` wrap; ``layer`` has ``flax.linen.ConvTranspose``'s
    fields or ``flax.nnx.ConvTranspose``'s."""
    kernel_size = _kernel_size(layer)
    rank = len(kernel_size)
    geometry = _geometry(layer, rank)
    if not geometry.taken:
        return geometry
    strides, _, kernel_dilation = geometry.value
    in_features, features = jnp.shape(inputs)[-1], _adapt.out_features(layer)
    expected = kernel_size + ((features, in_features) if layer.transpose_kernel else (in_features, features))
    try:
        padding = canonicalize_padding(layer.padding, rank)
    except (TypeError, ValueError) as e:
        return Decision.stock(f"padding ({e})")
    circular = padding == 'CIRCULAR'
    dilated_kernel = tuple((k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation, strict=True))
    if circular or padding in ('SAME', 'VALID'):
        padding = [_transposed_pads(k, s, 'VALID' if circular else padding)
                   for k, s in zip(dilated_kernel, strides, strict=True)]
    elif isinstance(padding, str):
        return Decision.stock(f"padding {padding!r}")  # lax raises its error
    if layer.transpose_kernel and jnp.shape(kernel) == expected:  # flipped, channels swapped
        kernel = jnp.swapaxes(jnp.flip(kernel, tuple(range(rank))), -1, -2)
        mask = None if layer.mask is None else jnp.swapaxes(jnp.flip(layer.mask, tuple(range(rank))), -1, -2)
        expected = expected[:-2] + expected[-2:][::-1]
    else:
        mask = layer.mask
    conv = dict(padding=padding, strides=(1,) * rank, rhs_dilation=kernel_dilation,
                lhs_dilation=strides, feature_group_count=1)
    if not circular:
        return _run_conv(layer, inputs, kernel, bias, expected, activation, conv, dilated_kernel, mask)
    y = _run_conv(layer, inputs, kernel, None, expected, None, conv, dilated_kernel, mask)
    if not y.taken:
        return y
    batch_dims = jnp.ndim(inputs) - rank - 1
    period = [n * s for n, s in zip(jnp.shape(inputs)[batch_dims:-1], strides, strict=True)]
    y = _wrap_periodically(y.value, period, batch_dims, layer.transpose_kernel)
    if bias is not None:
        y = y + jnp.asarray(bias, y.dtype)
    return Decision(_activations.apply(activation, y))


# --- the one path to the kernels -------------------------------------------------------------


def _run_conv(layer, inputs, kernel, bias, expected, activation, conv, dilated_kernel, mask=None):
    """``Decision``: ``conv`` (``jb.conv2d`` / ``jb.conv3d`` arguments with Flax's padding
    forms) of ``inputs`` ``(*batch, spatial..., C)`` on the kernels, the batch dims folded
    and restored, ``mask`` (the layer's unless given) applied to the kernel."""
    rank = len(dilated_kernel)
    if rank > 3:
        return Decision.stock(f"{rank}-D convolution")
    inputs = jnp.asarray(inputs)
    batch_dims = inputs.ndim - (rank + 1)
    if batch_dims < 0 or jnp.shape(kernel) != expected:
        return Decision.stock("unexpected shapes")  # the stock call raises its error
    why = _adapt.precision_why(getattr(layer, "precision", None))
    if why:
        return Decision.stock(why)
    batch_shape = inputs.shape[:batch_dims]
    if batch_dims != 1:  # (-1 cannot stand for a size next to a 0)
        inputs = jnp.reshape(inputs, (int(np.prod(batch_shape)),) + inputs.shape[batch_dims:])
    inputs, padding = _pad_by_mode(inputs, conv["padding"], dilated_kernel)
    if not isinstance(padding, str):
        if max(conv["lhs_dilation"]) > 1 and any(v < 0 for pair in padding for v in pair):
            # negative pads crop the dilated input: dilate it here, then crop it
            if any((n - 1) * d + 1 + min(lo, 0) + min(hi, 0) < 1 for n, d, (lo, hi) in zip(
                    inputs.shape[1:-1], conv["lhs_dilation"], padding, strict=True)):
                return Decision.stock("padding crops the whole input")
            inputs = lax.pad(inputs, jnp.zeros((), inputs.dtype), [(0, 0, 0)] + [
                (min(lo, 0), min(hi, 0), d - 1) for (lo, hi), d in zip(padding, conv["lhs_dilation"],
                                                                        strict=True)] + [(0, 0, 0)])
            padding, conv = [(max(lo, 0), max(hi, 0)) for lo, hi in padding], {**conv, "lhs_dilation": 1}
        cropped = _crop_negative_padding(inputs, padding, rank)
        if cropped is None:
            return Decision.stock("padding crops the whole input")
        inputs, padding = cropped
    elif padding.upper() not in ('SAME', 'VALID', 'SAME_LOWER'):
        return Decision.stock(f"padding {padding!r}")
    mask = layer.mask if mask is None else mask
    if mask is not None:
        if jnp.shape(mask) != jnp.shape(kernel):
            return Decision.stock("mask shape")
        kernel = kernel * mask
    operands = _adapt.kernel_operands(layer, inputs, kernel, bias)
    if not operands.taken:
        return operands
    inputs, kernel, bias, dtype = operands.value
    kw = {**conv, "padding": padding, "activation": activation, "dtype": dtype,
          "precision": getattr(layer, "precision", None)}
    if rank == 1:  # a 1-D convolution is a 2-D one over a single row
        kw.update({key: (1,) + _adapt.per_dim(kw[key], 1) for key in ("strides", "rhs_dilation", "lhs_dilation")})
        if not isinstance(padding, str):
            kw["padding"] = [(0, 0)] + list(padding)
        y = conv2d(inputs[:, None], kernel[None], bias, **kw)[:, 0]
    else:
        y = (conv2d if rank == 2 else conv3d)(inputs, kernel, bias, **kw)
    return Decision(jnp.reshape(y, batch_shape + y.shape[1:]))


# --- the modules -------------------------------------------------------------------------------


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
    call on existing parameters runs on the kernels for 1-D, 2-D and 3-D convolutions (kernel
    and input dilations, feature groups: grouped and depthwise), with every Flax padding
    form (``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'`` for 1-D, ints
    and ``(low, high)`` pairs; a negative pad crops), a float32 or bfloat16 computation,
    Flax's ``promote_dtype`` (or one returning arrays of those dtypes), a ``precision`` of
    ``jax_brgemm.precision``'s table and no custom ``conv_general_dilated``. Anything
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
        params = existing_params(
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


class ConvTranspose(nn.ConvTranspose):
    """A transposed convolution (channels last) with an optional fused activation, on
    jax_brgemm's convolution kernels.

    A drop-in for ``flax.linen.ConvTranspose`` (a subclass of it): the same fields in the same
    order, the same parameters, the same results; ``activation`` comes after the stock
    fields::

      >>> import jax, jax.numpy as jnp
      >>> import jax_brgemm as jb
      >>> layer = jb.nn.ConvTranspose(features=4, kernel_size=(3, 3), strides=2)
      >>> params = layer.init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
      >>> layer.apply(params, jnp.ones((1, 8, 8, 3))).shape
      (1, 16, 16, 4)

    ``init`` is flax's own call. A call on existing parameters runs ``lax.conv_transpose``'s
    input-dilated convolution on the kernels (1-D, 2-D, 3-D; strides, kernel dilation,
    ``transpose_kernel``, masks, ``'SAME'``, ``'VALID'``, ``'CIRCULAR'`` and explicit
    pads), with the dtype rules of ``Conv``; anything else is flax's call, followed by the
    activation.

    Attributes:
      features, kernel_size, strides, padding, kernel_dilation, use_bias, mask, dtype,
        param_dtype, precision, kernel_init, bias_init, transpose_kernel, promote_dtype,
        preferred_element_type: as in ``flax.linen.ConvTranspose``.
      activation: ``None``, ``"relu"``, ``"gelu"``, ``"sigmoid"`` or ``"tanh"`` (fused, but
        after the wrap with ``'CIRCULAR'`` padding).
    """

    activation: str | None = None

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the transposed convolution to ``inputs`` of shape ``(*batch_dims,
        spatial..., features)``, as Flax does. The result is in the computation dtype."""
        check.activation(self.activation, "jb.nn.ConvTranspose")
        inputs = jnp.asarray(inputs)
        size = _kernel_size(self)
        in_features = inputs.shape[-1] if inputs.ndim else 0
        shape = size + ((self.features, in_features) if self.transpose_kernel else (in_features, self.features))
        params = existing_params(self, shape) if inputs.ndim > len(size) else None
        if params is not None:
            y, why = conv_transpose_on_kernels(self, inputs, *params, self.activation)
            if not why:
                return y
        return _activations.apply(self.activation, super().__call__(inputs))


# --- geometry ----------------------------------------------------------------------------------


def _kernel_size(layer) -> tuple[int, ...]:
    """The kernel's spatial size; an int is a 1-D kernel (as in Flax)."""
    return (layer.kernel_size,) if isinstance(layer.kernel_size, int) else tuple(layer.kernel_size)


def _geometry(layer, rank: int) -> Decision:
    """``Decision((strides, input_dilation, kernel_dilation))``, one int each per spatial dim
    (a ConvTranspose has no input dilation: ones)."""
    values = tuple(_adapt.per_dim(getattr(layer, name, 1), rank)
                   for name in ("strides", "input_dilation", "kernel_dilation"))
    for v in values:
        if len(v) != rank or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1
                                 for d in v):
            return Decision.stock("unexpected strides or dilations")  # the stock call raises
    return Decision(values)


def _transposed_pads(k: int, s: int, padding: str) -> tuple[int, int]:
    """The pads ``lax.conv_transpose`` gives the input-dilated convolution for a dilated
    kernel extent ``k``, strides ``s`` and the forward convolution's ``padding`` name: the
    output is ``n * s`` long for 'SAME' and ``(n - 1) * s + k`` (at least ``n * s``) for
    'VALID'."""
    if padding == 'SAME':
        total = k + s - 2
        low = k - 1 if s > k - 1 else -(-total // 2)
    else:
        total = k + s - 2 + max(k - s, 0)
        low = k - 1
    return low, total - low


def _wrap_periodically(y, period, batch_dims, transpose_kernel):
    """Flax's ``'CIRCULAR'`` ConvTranspose: the output padded to whole periods (the input's
    size times the strides), then each spatial dim summed over its periods."""
    spatial = y.shape[batch_dims:-1]
    diffs = [-(n - p) % (2 * p) for n, p in zip(spatial, period, strict=True)]
    pads = [(d // 2, (d + 1) // 2) if transpose_kernel else ((d + 1) // 2, d // 2) for d in diffs]
    y = jnp.pad(y, [(0, 0)] * batch_dims + pads + [(0, 0)])
    for i, p in enumerate(period):
        axis = batch_dims + i
        y = y.reshape(y.shape[:axis] + (-1, p) + y.shape[axis + 1:]).sum(axis=axis)
    return y


def _pad_by_mode(inputs, padding, dilated_kernel):
    """``(inputs, padding)`` with Flax's ``'CIRCULAR'``, ``'REFLECT'`` and ``'CAUSAL'`` (1-D)
    paddings applied to the inputs, as Flax does, leaving ``'VALID'``; others unchanged."""
    if padding in ('CIRCULAR', 'REFLECT'):
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated_kernel] + [(0, 0)]
        mode = {'CIRCULAR': 'wrap', 'REFLECT': 'reflect'}[padding]
        return jnp.pad(inputs, pads, mode=mode), 'VALID'
    if padding == 'CAUSAL':
        pad = dilated_kernel[0] - 1
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


