"""Flax modules on jax_brgemm's kernels, drop-in replacements for their ``flax.linen`` twins.

Each module creates exactly the parameters of the stock module it replaces (names, shapes,
dtypes, initializers), so a checkpoint of a stock Flax model loads unchanged; only the
computation runs on the BRGEMM kernels, with the activation fused into them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import initializers
from flax.linen.dtypes import canonicalize_dtype
from flax.linen.linear import default_kernel_init
from flax.linen.module import Module, compact
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jax_brgemm.ops.dense import ACTIVATIONS, dense

__all__ = ["Dense", "LSTM"]


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
        from flax.linen.recurrent import flip_sequences

        from jax_brgemm.ops.lstm import lstm

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
        n = int(np.prod(batch_dims))
        kernel_i, kernel_h, bias = _LSTMCellParams(
            self.features, self.param_dtype, self.kernel_init, self.recurrent_kernel_init,
            self.bias_init, name="cell")(inputs.shape[-1])

        if initial_carry is None:
            key1, key2 = jax.random.split(jax.random.key(0) if init_key is None else init_key)
            mem_shape = tuple(batch_dims) + (self.features,)
            initial_carry = (self.carry_init(key1, mem_shape, self.param_dtype),
                             self.carry_init(key2, mem_shape, self.param_dtype))
        c0, h0 = initial_carry
        dtype = _compute_dtype(inputs, kernel_i, bias, dtype=self.dtype)
        # The stock cell's outputs take the dtype of f * c + i * g: the computation dtype
        # promoted with the carry's.
        out_dtype = jnp.result_type(dtype, c0.dtype, h0.dtype)

        if reverse:
            inputs = flip_sequences(inputs, seq_lengths, num_batch_dims=len(batch_dims),
                                    time_major=time_major)
        t = inputs.shape[0] if time_major else inputs.shape[-2]
        x = inputs.reshape((t, n, -1) if time_major else (n, t, -1))
        carry0 = (jnp.reshape(c0, (n, self.features)), jnp.reshape(h0, (n, self.features)))
        (c, h), y = lstm(x, kernel_i, kernel_h, bias, initial_carry=carry0, time_major=time_major,
                         dtype=dtype)
        y = y.astype(out_dtype).reshape(inputs.shape[:-1] + (self.features,))
        carry = (c.astype(out_dtype).reshape(c0.shape), h.astype(out_dtype).reshape(h0.shape))
        if reverse and keep_order:
            y = flip_sequences(y, seq_lengths, num_batch_dims=len(batch_dims), time_major=time_major)
        return (carry, y) if return_carry else y
