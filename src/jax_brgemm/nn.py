"""Flax modules on jax_brgemm's kernels, drop-in replacements for their ``flax.linen`` twins.

Each module has its stock twin's fields, in the stock order, followed by its own (such as
``activation``); it creates exactly the stock module's parameters (names, shapes, dtypes,
initializers), so a checkpoint of a stock Flax model loads unchanged. A configuration the
kernels cannot run (a custom ``dot_general``, a dtype other than float32 / bfloat16, a
``promote_dtype`` whose result they cannot take) computes exactly as the stock module does.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import initializers
from flax.linen.dtypes import canonicalize_dtype, promote_dtype
from flax.linen.linear import PromoteDtypeFn, default_kernel_init
from flax.linen.module import Module, compact
from flax.typing import Array, DotGeneralT, Dtype, Initializer, PrecisionLike
from jax import lax

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm.ops.dense import dense

__all__ = ["ACTIVATIONS", "Dense", "LSTM"]

#: The activations the modules fuse, by name, and the stock function each one matches
#: (what a stock layer followed by that function computes).
ACTIVATIONS: dict[str, Callable[[Array], Array]] = dict(_activations.FUNCTIONS)


def dense_on_kernels(layer, inputs, kernel, bias, activation=None):
    """``(y, "")``: a Dense ``layer``'s result on the kernels, or ``(None, why not)``.

    ``layer`` has ``flax.linen.Dense``'s fields (``dtype``, ``promote_dtype``,
    ``dot_general``, ``dot_general_cls``): a stock module or this module's ``Dense``.
    """
    if layer.dot_general is not None or layer.dot_general_cls is not None:
        return None, "custom dot_general"
    if layer.promote_dtype is promote_dtype:
        # Flax's promotion, except that the kernel and bias go in as they are and are cast
        # inside the custom call: their gradients stay in the parameter dtype without a
        # rounding to the computation dtype in between.
        try:
            dtype = np.dtype(canonicalize_dtype(inputs, kernel, bias, dtype=layer.dtype))
        except ValueError as e:  # the stock computation raises it again
            return None, f"dtype ({e})"
        if dtype not in check.KERNEL_DTYPES:
            return None, f"{dtype} computation"
        kernel, bias = (a if a is None or a.dtype in check.KERNEL_DTYPES else jnp.asarray(a, dtype)
                        for a in (kernel, bias))
        return dense(jnp.asarray(inputs, dtype), kernel, bias, activation=activation, dtype=dtype), ""
    p_inputs, p_kernel, p_bias = layer.promote_dtype(inputs, kernel, bias, dtype=layer.dtype)
    dtypes = {np.dtype(a.dtype) for a in (p_inputs, p_kernel, p_bias) if a is not None}
    if len(dtypes) != 1 or not dtypes <= set(check.KERNEL_DTYPES):
        return None, "custom promote_dtype to " + ", ".join(sorted(map(str, dtypes)))
    return dense(p_inputs, p_kernel, p_bias, activation=activation), ""


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


class _LSTMCellParams(Module):
    """The parameters of ``flax.linen.OptimizedLSTMCell`` (same names, shapes, initializers),
    concatenated into the fused layer's ``kernel_i (C, 4K)``, ``kernel_h (K, 4K)`` and
    ``bias (4K,)``, gates in the order i, f, g, o."""

    features: int
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = default_kernel_init
    recurrent_kernel_init: Initializer = initializers.orthogonal()
    bias_init: Initializer = initializers.zeros_init()

    @compact
    def __call__(self, in_features: int):
        from flax.linen.recurrent import DenseParams

        x_like = jax.ShapeDtypeStruct((1, in_features), self.param_dtype)
        h_like = jax.ShapeDtypeStruct((1, self.features), self.param_dtype)
        ki, kh, bh = [], [], []
        for gate in "ifgo":
            k, _ = DenseParams(features=self.features, use_bias=False, param_dtype=self.param_dtype,
                               kernel_init=self.kernel_init, bias_init=self.bias_init,
                               name=f"i{gate}")(x_like)
            r, b = DenseParams(features=self.features, use_bias=True, param_dtype=self.param_dtype,
                               kernel_init=self.recurrent_kernel_init, bias_init=self.bias_init,
                               name=f"h{gate}")(h_like)
            ki.append(k)
            kh.append(r)
            bh.append(b)
        return jnp.concatenate(ki, -1), jnp.concatenate(kh, -1), jnp.concatenate(bh, -1)


class LSTM(Module):
    """An LSTM over a whole sequence, as one fused BRGEMM custom call per pass: a drop-in for
    ``flax.linen.RNN(flax.linen.OptimizedLSTMCell(features))``.

    Same parameters as the stock module (``{'cell': {'ii', 'if', 'ig', 'io': {'kernel'},
    'hi', 'hf', 'hg', 'ho': {'kernel', 'bias'}}}``, same initializers), the same call
    conventions (``initial_carry=``, carry ``(c, h)``, ``return_carry``, ``time_major``,
    ``reverse`` / ``keep_order``, any number of batch dims) and the same output dtypes, so a
    stock checkpoint loads unchanged::

      >>> import jax, jax.numpy as jnp
      >>> import jax_brgemm as jb
      >>> layer = jb.nn.LSTM(features=4)
      >>> params = layer.init(jax.random.key(0), jnp.ones((2, 5, 3)))
      >>> sorted(params['params']['cell'])
      ['hf', 'hg', 'hi', 'ho', 'if', 'ig', 'ii', 'io']

    Attributes:
      features: the hidden size K.
      time_major: inputs are ``(time, *batch, features)`` instead of
        ``(*batch, time, features)`` (default: False).
      return_carry: return ``(carry, outputs)`` instead of the outputs (default: False).
      reverse: process the sequence from last to first (default: False).
      keep_order: with ``reverse``, return the outputs in the original order.
      dtype: the computation dtype, float32 or bfloat16 (default: infer from inputs and
        params). bfloat16 multiplies with float32 accumulation; the cell state and the
        element-wise math are float32 either way.
      param_dtype: the dtype passed to parameter initializers (default: float32).
      kernel_init, recurrent_kernel_init, bias_init, carry_init: as
        ``flax.linen.OptimizedLSTMCell``'s.
    """

    features: int
    time_major: bool = False
    return_carry: bool = False
    reverse: bool = False
    keep_order: bool = False
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = default_kernel_init
    recurrent_kernel_init: Initializer = initializers.orthogonal()
    bias_init: Initializer = initializers.zeros_init()
    carry_init: Initializer = initializers.zeros_init()

    @compact
    def __call__(self, inputs: Array, *, initial_carry=None, init_key=None, seq_lengths=None,
                 return_carry: bool | None = None, time_major: bool | None = None,
                 reverse: bool | None = None, keep_order: bool | None = None):
        """Runs the LSTM over ``inputs``; arguments override the attributes as in
        ``flax.linen.RNN.__call__``. ``seq_lengths`` is accepted where the stock module's
        result does not depend on it beyond reversing (``return_carry=False``), and refused
        with ``return_carry=True`` (the stock module then picks each sequence's own last
        carry, which the fused kernel does not produce)."""
        return_carry = self.return_carry if return_carry is None else return_carry
        time_major = self.time_major if time_major is None else time_major
        reverse = self.reverse if reverse is None else reverse
        keep_order = self.keep_order if keep_order is None else keep_order
        if seq_lengths is not None and return_carry:
            raise NotImplementedError(
                "jax_brgemm.nn.LSTM: seq_lengths with return_carry=True (each sequence's own last "
                "carry) is not supported; use flax.linen.RNN for that, or pad and take the carry "
                "from the outputs")
        if inputs.ndim < 3:
            raise ValueError(f"LSTM: inputs must be (*batch, time, features) or, time-major, "
                             f"(time, *batch, features) with at least one batch dim; got shape "
                             f"{inputs.shape}")
        batch_dims = inputs.shape[1:-1] if time_major else inputs.shape[:-2]
        kernel_i, kernel_h, bias = _LSTMCellParams(
            self.features, self.param_dtype, self.kernel_init, self.recurrent_kernel_init,
            self.bias_init, name="cell")(inputs.shape[-1])

        if initial_carry is None:
            key1, key2 = jax.random.split(jax.random.key(0) if init_key is None else init_key)
            mem_shape = tuple(batch_dims) + (self.features,)
            initial_carry = (self.carry_init(key1, mem_shape, self.param_dtype),
                             self.carry_init(key2, mem_shape, self.param_dtype))
        dtype = check.compute_dtype("jb.nn.LSTM", self.dtype, inputs, kernel_i, bias)
        return lstm_on_kernels(inputs, kernel_i, kernel_h, bias, initial_carry, dtype=dtype,
                               time_major=time_major, reverse=reverse, keep_order=keep_order,
                               seq_lengths=seq_lengths, return_carry=return_carry)


def lstm_on_kernels(inputs, kernel_i, kernel_h, bias, initial_carry, *, dtype, time_major=False,
                    reverse=False, keep_order=False, seq_lengths=None, return_carry=False):
    """What ``flax.linen.RNN(OptimizedLSTMCell)`` computes on ``inputs`` (any number of batch
    dims), as one fused ``jb.lstm`` call: the stock cell's gate math, the stock module's
    conventions for ``reverse`` / ``keep_order`` / ``seq_lengths`` (flips only) and its output
    dtypes. ``kernel_i (C, 4K)``, ``kernel_h (K, 4K)``, ``bias (4K,)`` are the cell's
    parameters concatenated in gate order i, f, g, o; ``initial_carry`` is ``(c0, h0)``
    shaped ``(*batch, K)``; ``dtype`` the computation dtype (float32 or bfloat16)."""
    from flax.linen.recurrent import flip_sequences

    from jax_brgemm.ops.lstm import lstm

    features = kernel_h.shape[0]
    batch_dims = inputs.shape[1:-1] if time_major else inputs.shape[:-2]
    n = int(np.prod(batch_dims))
    c0, h0 = initial_carry
    # The stock cell's outputs take the dtype of f * c + i * g: the computation dtype
    # promoted with the carry's.
    out_dtype = jnp.result_type(dtype, c0.dtype, h0.dtype)
    if reverse:
        inputs = flip_sequences(inputs, seq_lengths, num_batch_dims=len(batch_dims),
                                time_major=time_major)
    t = inputs.shape[0] if time_major else inputs.shape[-2]
    x = inputs.reshape((t, n, -1) if time_major else (n, t, -1))
    carry0 = (jnp.reshape(c0, (n, features)), jnp.reshape(h0, (n, features)))
    (c, h), y = lstm(x, kernel_i, kernel_h, bias, initial_carry=carry0, time_major=time_major,
                     dtype=dtype)
    y = y.astype(out_dtype).reshape(inputs.shape[:-1] + (features,))
    carry = (c.astype(out_dtype).reshape(c0.shape), h.astype(out_dtype).reshape(h0.shape))
    if reverse and keep_order:
        y = flip_sequences(y, seq_lengths, num_batch_dims=len(batch_dims), time_major=time_major)
    return (carry, y) if return_carry else y


# --- Conv ---------------------------------------------------------------------------------

from typing import Sequence  # noqa: E402

from flax.linen.linear import _conv_dimension_numbers, canonicalize_padding  # noqa: E402

from jax_brgemm.ops.conv import conv2d  # noqa: E402

__all__ += ["Conv", "conv_on_kernels"]


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
        kernel_size = ((self.kernel_size,) if isinstance(self.kernel_size, int)
                       else tuple(self.kernel_size))
        rank = len(kernel_size)

        def broadcast(v):
            v = 1 if v is None else v
            return (v,) * rank if isinstance(v, int) else tuple(v)

        inputs = raw_inputs = jnp.asarray(inputs)
        batch_dims = inputs.ndim - (rank + 1)
        if batch_dims < 0:
            raise ValueError(f"{op}: a {rank}-D convolution needs inputs of rank >= {rank + 1} "
                             f"(spatial dims and features), got shape {inputs.shape}")
        batch_shape = inputs.shape[:batch_dims]
        if batch_dims != 1:
            inputs = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
        strides, input_dilation, kernel_dilation = map(
            broadcast, (self.strides, self.input_dilation, self.kernel_dilation))

        padding = canonicalize_padding(self.padding, rank)
        if padding in ('CIRCULAR', 'REFLECT'):
            dilated = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]
            pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
            inputs = jnp.pad(inputs, pads, mode={'CIRCULAR': 'wrap', 'REFLECT': 'reflect'}[padding])
            padding = 'VALID'
        elif padding == 'CAUSAL':
            if rank != 1:
                raise ValueError('Causal padding is only implemented for 1D convolutions.')
            inputs = jnp.pad(inputs, [(0, 0), (kernel_dilation[0] * (kernel_size[0] - 1), 0), (0, 0)])
            padding = 'VALID'

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
        bias = self.param('bias', self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None

        # the kernels take the unpadded, unflattened inputs and the unmasked kernel
        y, _ = conv_on_kernels(self, raw_inputs, raw_kernel, bias, self.activation)
        if y is not None:
            return y
        # flax.linen.Conv's computation, for what the kernels cannot run
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if self.conv_general_dilated_cls is not None:
            conv = self.conv_general_dilated_cls()
        else:
            conv = self.conv_general_dilated or lax.conv_general_dilated
        y = conv(inputs, kernel, strides, padding, lhs_dilation=input_dilation,
                 rhs_dilation=kernel_dilation, dimension_numbers=_conv_dimension_numbers(inputs.shape),
                 feature_group_count=self.feature_group_count, precision=self.precision)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        y = _activations.apply(self.activation, y)
        if batch_dims != 1:
            y = jnp.reshape(y, batch_shape + y.shape[1:])
        return y


def conv_on_kernels(layer, inputs, kernel, bias, activation=None):
    """``(y, "")``: a Conv ``layer``'s result on the kernels, or ``(None, why not)``.

    ``layer`` has ``flax.linen.Conv``'s fields (``kernel_size``, ``strides``, ``padding``,
    dilations, ``feature_group_count``, ``mask``, ``dtype``, ``promote_dtype``,
    ``conv_general_dilated(_cls)``): a stock module or this module's ``Conv``. ``inputs``
    are the layer's call argument, ``kernel`` and ``bias`` its parameters (the kernel not
    yet masked); the result is what the layer returns (batch dims restored), with
    ``activation`` fused.
    """
    kernel_size = ((layer.kernel_size,) if isinstance(layer.kernel_size, int)
                   else tuple(layer.kernel_size))
    rank = len(kernel_size)

    def broadcast(v):
        v = 1 if v is None else v
        return (v,) * rank if isinstance(v, int) else tuple(v)

    if rank not in (1, 2):
        return None, f"{rank}-D convolution"
    if layer.feature_group_count != 1:
        return None, "feature groups"
    if layer.conv_general_dilated is not None or layer.conv_general_dilated_cls is not None:
        return None, "custom conv_general_dilated"
    strides, input_dilation, kernel_dilation = map(
        broadcast, (layer.strides, layer.input_dilation, layer.kernel_dilation))
    if any(d != 1 for d in input_dilation):
        return None, "input dilation"
    if any(d != 1 for d in kernel_dilation):
        return None, "kernel dilation"
    inputs = jnp.asarray(inputs)
    batch_dims = inputs.ndim - (rank + 1)
    if batch_dims < 0 or jnp.shape(kernel) != kernel_size + (inputs.shape[-1], layer.features):
        return None, "unexpected shapes"
    batch_shape = inputs.shape[:batch_dims]
    if batch_dims != 1:
        inputs = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
    try:
        padding = canonicalize_padding(layer.padding, rank)
    except (TypeError, ValueError) as e:
        return None, f"padding ({e})"
    if padding in ('CIRCULAR', 'REFLECT'):
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in kernel_size] + [(0, 0)]
        inputs = jnp.pad(inputs, pads, mode={'CIRCULAR': 'wrap', 'REFLECT': 'reflect'}[padding])
        padding = 'VALID'
    elif padding == 'CAUSAL':
        if rank != 1:
            return None, "causal padding of a 2-D convolution"
        inputs = jnp.pad(inputs, [(0, 0), (kernel_size[0] - 1, 0), (0, 0)])
        padding = 'VALID'
    if not isinstance(padding, str):
        padding = [tuple(p) for p in padding]
        if any(v < 0 for p in padding for v in p):
            # a negative pad crops: slice it off here, so the kernels see pads >= 0 (stock
            # XLA's own cropping convolution reads garbage now and then)
            spatial = inputs.shape[1:1 + rank]
            if any(n + min(lo, 0) + min(hi, 0) < 1 for n, (lo, hi) in zip(spatial, padding)):
                return None, "padding crops the whole input"
            inputs = inputs[(slice(None),) + tuple(slice(-min(lo, 0), n + min(hi, 0))
                                                   for n, (lo, hi) in zip(spatial, padding))]
            padding = [(max(lo, 0), max(hi, 0)) for lo, hi in padding]
    elif padding.upper() not in ('SAME', 'VALID', 'SAME_LOWER'):
        return None, f"padding {padding!r}"
    if layer.mask is not None:
        if jnp.shape(layer.mask) != jnp.shape(kernel):
            return None, "mask shape"
        kernel = kernel * layer.mask
    if layer.promote_dtype is promote_dtype:
        try:
            dtype = np.dtype(canonicalize_dtype(inputs, kernel, bias, dtype=layer.dtype))
        except ValueError as e:  # the stock computation raises it again
            return None, f"dtype ({e})"
        if dtype not in check.KERNEL_DTYPES:
            return None, f"{dtype} computation"
        # the kernel and bias go in as they are and are cast inside the custom call
        kernel, bias = (a if a is None or a.dtype in check.KERNEL_DTYPES else jnp.asarray(a, dtype)
                        for a in (kernel, bias))
        inputs = jnp.asarray(inputs, dtype)
    else:
        inputs, kernel, bias = layer.promote_dtype(inputs, kernel, bias, dtype=layer.dtype)
        dtypes = {np.dtype(a.dtype) for a in (inputs, kernel, bias) if a is not None}
        if len(dtypes) != 1 or not dtypes <= set(check.KERNEL_DTYPES):
            return None, "custom promote_dtype to " + ", ".join(sorted(map(str, dtypes)))
        dtype = dtypes.pop()
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
    return y, ""
