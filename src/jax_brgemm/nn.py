"""Flax modules on jax_brgemm's kernels, drop-in replacements for their ``flax.linen`` twins.

Each module has its stock twin's fields, in the stock order, followed by its own (such as
``activation``); it creates exactly the stock module's parameters (names, shapes, dtypes,
initializers), so a checkpoint of a stock Flax model loads unchanged. A configuration the
kernels cannot run (a custom ``dot_general``, a dtype other than float32 / bfloat16, a
``promote_dtype`` whose result they cannot take) computes exactly as the stock module does.
"""

from __future__ import annotations

from typing import Any, Callable

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

__all__ = ["ACTIVATIONS", "Dense"]

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
