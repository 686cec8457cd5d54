"""A Flax layer's computation and parameters adapted to the kernels: what the modules of
``jax_brgemm.nn`` and ``accelerate()`` (which runs stock Flax modules) share.

Every function answers ``(result, "")`` or ``(None, why not)``: a configuration the kernels
cannot take falls back to the stock computation, and ``accelerate()`` reports the reason.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import canonicalize_dtype, promote_dtype

from jax_brgemm import _validate as check

#: The LSTM's gates in the order the fused layer (and ``OptimizedLSTMCell``) computes them.
GATES = "ifgo"


def computation_dtype(requested, *arrays):
    """``(dtype, "")``: Flax's computation dtype (``requested``, or the promotion of the
    arrays' dtypes; None entries skipped) when it is one the kernels compute in."""
    try:
        dtype = np.dtype(canonicalize_dtype(*arrays, dtype=requested))
    except ValueError as e:  # the stock computation raises it again
        return None, f"dtype ({e})"
    if dtype not in check.KERNEL_DTYPES:
        return None, f"{dtype} computation"
    return dtype, ""


def kernel_operands(layer, inputs, kernel, bias):
    """``((inputs, kernel, bias, dtype), "")``: a Dense or Conv layer's operands as the
    kernels take them, with the computation dtype, from the layer's ``dtype`` and
    ``promote_dtype`` fields.

    With Flax's own ``promote_dtype`` the dtype is Flax's and only the inputs are cast to it:
    the kernel and bias go in as they are and are cast inside the custom call, so their
    gradients stay in the parameter dtype without a rounding to the computation dtype in
    between. A custom ``promote_dtype`` is called, and its arrays are taken when they share
    a dtype the kernels compute in.
    """
    if layer.promote_dtype is promote_dtype:
        dtype, why = computation_dtype(layer.dtype, inputs, kernel, bias)
        if dtype is None:
            return None, why
        kernel, bias = (a if a is None or a.dtype in check.KERNEL_DTYPES else jnp.asarray(a, dtype)
                        for a in (kernel, bias))
        return (jnp.asarray(inputs, dtype), kernel, bias, dtype), ""
    inputs, kernel, bias = layer.promote_dtype(inputs, kernel, bias, dtype=layer.dtype)
    dtypes = {np.dtype(a.dtype) for a in (inputs, kernel, bias) if a is not None}
    if len(dtypes) != 1 or not dtypes <= set(check.KERNEL_DTYPES):
        return None, "custom promote_dtype to " + ", ".join(sorted(map(str, dtypes)))
    return (inputs, kernel, bias, dtypes.pop()), ""


def lstm_params(cell):
    """``((kernel_i (C, 4K), kernel_h (K, 4K), bias (4K,)), "")``: the fused layer's
    parameters from an LSTM cell's parameter tree.

    ``cell`` is what ``flax.linen.OptimizedLSTMCell`` and ``LSTMCell`` both create: per gate
    an input kernel ``i<gate>`` without bias and a recurrent kernel ``h<gate>`` with one;
    the fused layer takes each kind side by side in ``GATES`` order.
    """
    names = [f"{kind}{gate}" for kind in "ih" for gate in GATES]
    if (any(n not in cell or "kernel" not in cell[n] for n in names)
            or any("bias" not in cell[f"h{g}"] for g in GATES)
            or any("bias" in cell[f"i{g}"] for g in GATES)):
        return None, "parameters not created yet"
    kernel_i = jnp.concatenate([cell[f"i{g}"]["kernel"] for g in GATES], axis=-1)
    kernel_h = jnp.concatenate([cell[f"h{g}"]["kernel"] for g in GATES], axis=-1)
    bias = jnp.concatenate([cell[f"h{g}"]["bias"] for g in GATES], axis=-1)
    return (kernel_i, kernel_h, bias), ""
