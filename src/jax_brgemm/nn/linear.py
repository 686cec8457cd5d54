"""``Dense``: ``flax.linen.Dense`` on the fully-connected kernels, and the function that runs
a stock Dense-like layer's call on them (for ``accelerate()``)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.typing import Array

from jax_brgemm import _activations
from jax_brgemm import _validate as check
from jax_brgemm.nn import _adapt
from jax_brgemm.nn._adapt import Decision
from jax_brgemm.ops.dense import dense

__all__ = ["Dense", "dense_on_kernels", "existing_params"]


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
        params = existing_params(self, (jnp.shape(inputs)[-1], self.features))
        if params is not None:
            y, why = dense_on_kernels(self, inputs, *params, self.activation)
            if not why:
                return y
        return _activations.apply(self.activation, super().__call__(inputs))


def existing_params(layer, kernel_shape):
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
