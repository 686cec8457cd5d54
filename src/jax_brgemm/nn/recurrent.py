"""``LSTM``: ``flax.linen.RNN(flax.linen.OptimizedLSTMCell(...))`` as one fused LSTM call
per pass, and the function that runs such a stock call on the kernels (for
``accelerate()``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import initializers
from flax.linen.linear import default_kernel_init
from flax.linen.module import Module, compact
from flax.linen.recurrent import RNN, DenseParams, OptimizedLSTMCell, flip_sequences
from flax.typing import Array, Dtype, Initializer

from jax_brgemm.nn import _adapt
from jax_brgemm.ops.lstm import lstm

__all__ = ["LSTM", "lstm_on_kernels", "seq_lengths_problem"]


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
        x_like = jax.ShapeDtypeStruct((1, in_features), self.param_dtype)
        h_like = jax.ShapeDtypeStruct((1, self.features), self.param_dtype)
        cell = {}
        for gate in _adapt.GATES:
            k, _ = DenseParams(features=self.features, use_bias=False, param_dtype=self.param_dtype,
                               kernel_init=self.kernel_init, bias_init=self.bias_init,
                               name=f"i{gate}")(x_like)
            r, b = DenseParams(features=self.features, use_bias=True, param_dtype=self.param_dtype,
                               kernel_init=self.recurrent_kernel_init, bias_init=self.bias_init,
                               name=f"h{gate}")(h_like)
            cell[f"i{gate}"], cell[f"h{gate}"] = {"kernel": k}, {"kernel": r, "bias": b}
        params, _ = _adapt.lstm_params(cell)
        return params


class LSTM(Module):
    """An LSTM over a whole sequence, as one fused BRGEMM custom call per pass: a drop-in for
    ``flax.linen.RNN(flax.linen.OptimizedLSTMCell(features))``.

    Same parameters as the stock module (``{'cell': {'ii', 'if', 'ig', 'io': {'kernel'},
    'hi', 'hf', 'hg', 'ho': {'kernel', 'bias'}}}``, same initializers), the same call
    conventions (``initial_carry=``, carry ``(c, h)``, ``return_carry``, ``time_major``,
    ``reverse`` / ``keep_order``, ``seq_lengths``, any number of batch dims) and the same
    output dtypes, so a stock checkpoint loads unchanged::

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
      dtype: the computation dtype (default: infer from inputs and params). float32 and
        bfloat16 run on the kernels: bfloat16 multiplies with float32 accumulation, the
        cell state and the element-wise math are float32 either way. Other dtypes
        (float16, float64) compute as the stock module does.
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
        ``flax.linen.RNN.__call__``. With ``seq_lengths`` and ``return_carry=True`` the carry
        is each sequence's own last one, as the stock module selects it, on the kernels for
        one batch dim (more: the stock module's computation)."""
        return_carry = self.return_carry if return_carry is None else return_carry
        time_major = self.time_major if time_major is None else time_major
        reverse = self.reverse if reverse is None else reverse
        keep_order = self.keep_order if keep_order is None else keep_order
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
        dtype, _ = _adapt.computation_dtype(self.dtype, inputs, kernel_i, bias)
        why = ""
        if seq_lengths is not None and return_carry:
            error, why = seq_lengths_problem(inputs, seq_lengths, time_major)
            if error is not None:
                raise error(f"jb.nn.LSTM: {why}")
        if dtype is None or why:  # a dtype the kernels do not take (float16, float64): stock
            return self._stock(inputs, kernel_i, kernel_h, bias, initial_carry, time_major=time_major,
                               reverse=reverse, keep_order=keep_order, seq_lengths=seq_lengths,
                               return_carry=return_carry)
        return lstm_on_kernels(inputs, kernel_i, kernel_h, bias, initial_carry, dtype=dtype,
                               time_major=time_major, reverse=reverse, keep_order=keep_order,
                               seq_lengths=seq_lengths, return_carry=return_carry)

    def _stock(self, inputs, kernel_i, kernel_h, bias, initial_carry, **call):
        """``flax.linen.RNN(OptimizedLSTMCell)``'s own computation on these parameters."""
        k = self.features
        cell = {}
        for j, gate in enumerate(_adapt.GATES):
            cols = slice(j * k, (j + 1) * k)
            cell[f"i{gate}"] = {"kernel": kernel_i[:, cols]}
            cell[f"h{gate}"] = {"kernel": kernel_h[:, cols], "bias": bias[cols]}
        stock = RNN(OptimizedLSTMCell(k, dtype=self.dtype, param_dtype=self.param_dtype))
        return stock.apply({"params": {"cell": cell}}, inputs, initial_carry=initial_carry, **call)


def lstm_on_kernels(inputs, kernel_i, kernel_h, bias, initial_carry, *, dtype, time_major=False,
                    reverse=False, keep_order=False, seq_lengths=None, return_carry=False):
    """What ``flax.linen.RNN(OptimizedLSTMCell)`` computes on ``inputs`` (any number of batch
    dims), as one fused ``jb.lstm`` call: the stock cell's gate math, the stock module's
    conventions for ``reverse`` / ``keep_order`` / ``seq_lengths`` (flips, and with
    ``return_carry`` each sequence's own last carry, for which ``seq_lengths_problem`` must
    have found none) and its output dtypes. ``kernel_i (C, 4K)``, ``kernel_h (K, 4K)``,
    ``bias (4K,)`` are the cell's parameters concatenated in gate order i, f, g, o;
    ``initial_carry`` is ``(c0, h0)`` shaped ``(*batch, K)``; ``dtype`` the computation
    dtype (float32 or bfloat16)."""
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
    t, c = (inputs.shape[0] if time_major else inputs.shape[-2]), inputs.shape[-1]
    # explicit sizes: a -1 cannot be inferred when N or T is 0
    x = inputs.astype(dtype).reshape((t, n, c) if time_major else (n, t, c))
    carry0 = (jnp.reshape(c0, (n, features)), jnp.reshape(h0, (n, features)))
    (c, h), y = lstm(x, kernel_i, kernel_h, bias, initial_carry=carry0, time_major=time_major,
                     dtype=dtype, seq_lengths=seq_lengths if return_carry else None)
    y = y.astype(out_dtype).reshape(inputs.shape[:-1] + (features,))
    carry = (c.astype(out_dtype).reshape(c0.shape), h.astype(out_dtype).reshape(h0.shape))
    if reverse and keep_order:
        y = flip_sequences(y, seq_lengths, num_batch_dims=len(batch_dims), time_major=time_major)
    return (carry, y) if return_carry else y


def seq_lengths_problem(inputs, seq_lengths, time_major):
    """``(None, "")`` when the fused call selects each sequence's own last carry as
    ``flax.linen.RNN(..., seq_lengths=seq_lengths, return_carry=True)`` does on ``inputs``;
    else ``(the exception a module raises, why)`` for bad ``seq_lengths``, or ``(None, why)``
    where only the stock computation reproduces the stock result (over several batch dims
    Flax selects along the first one only; over none it has no rows)."""
    batch = inputs.shape[1:-1] if time_major else inputs.shape[:-2]
    if len(batch) != 1:
        return None, f"seq_lengths with return_carry over {len(batch)} batch dims, not one"
    if not hasattr(seq_lengths, "dtype") or np.dtype(seq_lengths.dtype).kind not in "iu":
        got = getattr(seq_lengths, "dtype", type(seq_lengths).__name__)
        return TypeError, f"seq_lengths must be an integer array, got {got}"
    if tuple(seq_lengths.shape) != tuple(batch):
        return ValueError, (f"seq_lengths must have shape (batch,) = {tuple(batch)}, got "
                            f"{tuple(seq_lengths.shape)}")
    if inputs.shape[0 if time_major else -2] == 0:
        return ValueError, "seq_lengths with return_carry needs at least one time step"
    return None, ""
