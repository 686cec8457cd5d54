"""``accelerate()``'s rules for the Transformer layers of ``flax.nnx``: ``MultiHeadAttention``
(its attention on ``jb.dot_product_attention``), ``LinearGeneral`` and ``Einsum`` (on the FC
kernels where they are a matrix product); and the einsum-as-matrix-product analysis that
linen's ``nn.Einsum`` rule shares.

The rules reuse linen's adaptations (``jax_brgemm.nn.attention``): an NNX layer is handed to
them as a view with linen's field names and conventions. Each rule answers ``(result, why
not)`` as the other NNX rules do (``jax_brgemm.nnx._accelerate``).
"""

from __future__ import annotations

import contextlib
import threading
import types

import jax.numpy as jnp
import numpy as np
import opt_einsum
from flax import nnx
from flax.nnx.nn import attention as stock_attention
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn import linear as stock_linear

from jax_brgemm import nn as jbnn
from jax_brgemm.nn.linear import dense_on_kernels
from jax_brgemm.nnx.linear import kernel_and_bias

_state = threading.local()


def _bind(names, args, kwargs):
    """The call's arguments by name (``names`` in the stock signature's order), or None for
    arguments the stock signature does not have."""
    if len(args) > len(names) or set(kwargs) - set(names[len(args):]):
        return None
    return {**dict(zip(names, args)), **kwargs}


def linen_view(module, **fields):
    """An NNX ``LinearGeneral`` / ``Einsum`` (or a linen ``Einsum``) with the fields of a
    linen Dense, as the linen adaptations read them: ``dot_general`` None for the stock
    product, ``promote_dtype`` called with the arrays as separate arguments."""
    promote = module.promote_dtype
    if isinstance(module, nnx.Module) and promote is not nnx_dtypes.promote_dtype:
        promote = lambda *arrays, dtype: module.promote_dtype(arrays, dtype=dtype)  # noqa: E731
    return types.SimpleNamespace(
        dtype=module.dtype, promote_dtype=promote,
        preferred_element_type=module.preferred_element_type,
        dot_general=getattr(module, "dot_general", None),
        dot_general_cls=getattr(module, "dot_general_cls", None), **fields)


def linear_general(module, next_call, args, kwargs):
    """``nnx.LinearGeneral`` over the input's trailing axes, without ``batch_axis``: linen's
    DenseGeneral on the FC kernels."""
    call = _bind(("inputs", "out_sharding"), args, kwargs)
    why = ("unexpected arguments" if call is None or not hasattr(call.get("inputs"), "ndim")
           else "out_sharding" if call.get("out_sharding") is not None
           else "batch_axis" if module.batch_axis else "")
    y = None
    if not why:
        view = linen_view(module, batch_dims=(), axis=module.axis, features=module.out_features)
        y, why = jbnn.dense_general_on_kernels(view, call["inputs"], *kernel_and_bias(module))
    return (y, "") if y is not None else (next_call(*args, **kwargs), why)


def einsum(module, next_call, args, kwargs):
    """``nnx.Einsum`` where its equation is a matrix product (see ``einsum_on_kernels``)."""
    call = _bind(("inputs", "einsum_str", "out_sharding"), args, kwargs)
    if call is None or not hasattr(call.get("inputs"), "ndim"):
        why = "unexpected arguments"
    elif call.get("out_sharding") is not None:
        why = "out_sharding"
    elif module.einsum_op is not jnp.einsum:
        why = "custom einsum_op"
    else:
        spec = call.get("einsum_str") or module.einsum_str
        y, why = einsum_on_kernels(linen_view(module), spec, call["inputs"],
                                   *kernel_and_bias(module))
        if y is not None:
            return y, ""
    return next_call(*args, **kwargs), why


def einsum_on_kernels(layer, spec, inputs, kernel, bias):
    """``(y, "")``: an Einsum layer's ``spec`` (``"input,kernel->output"``) of ``inputs`` and
    ``kernel`` plus ``bias`` on the FC kernels, or ``(None, why not)``. ``layer`` has a linen
    Dense's dtype fields (``linen_view``).

    Taken when it is a matrix product: the kernel's axes are the contracted ones, which end
    the input (in any order), and the features, which end the output (in any order), after
    the input's other axes in their order; e.g. ``"...d,dnh->...nh"`` or ``"btnh,nhd->btd"``.
    The kernel is transposed to that order (a parameter-sized copy) and the rest reshaped.
    """
    if not isinstance(spec, str):
        return None, "unexpected arguments"
    try:
        operands, out, _ = opt_einsum.parser.parse_einsum_input((spec.replace(" ", ""), inputs,
                                                                  kernel))
    except (ValueError, TypeError, IndexError):  # the stock call raises it again
        return None, "einsum_str"
    x_axes, k_axes = operands.split(",")
    if any(len(set(s)) != len(s) for s in (x_axes, k_axes, out)):
        return None, "an axis repeated within an operand"
    if set(x_axes) & set(k_axes) & set(out):
        return None, "axes of the input, kernel and output (a batched product)"
    if (set(x_axes) | set(k_axes)) - set(out) != set(x_axes) & set(k_axes):
        return None, "axes summed out of one operand alone"
    lead = [a for a in x_axes if a not in k_axes]
    contracted = x_axes[len(lead):]
    features = out[len(lead):]
    if not contracted or list(x_axes[:len(lead)]) != lead:
        return None, "contracting axes other than the input's last ones"
    if list(out[:len(lead)]) != lead:
        return None, "output axes other than the input's others, then the features"
    if inputs.ndim != len(x_axes) or kernel.ndim != len(k_axes):
        return None, "parameter shapes do not match the inputs"
    size = dict(zip(k_axes, kernel.shape))
    if any(size[a] != d for a, d in zip(contracted, inputs.shape[len(lead):])):
        return None, "parameter shapes do not match the inputs"
    c = int(np.prod([size[a] for a in contracted], dtype=np.int64))
    k = int(np.prod([size[a] for a in features], dtype=np.int64))
    if bias is not None and bias.size != k:
        return None, "bias shape"
    matrix = jnp.transpose(kernel, [k_axes.index(a) for a in contracted + features])
    lead_shape = inputs.shape[:len(lead)]
    y, why = dense_on_kernels(layer, inputs.reshape(lead_shape + (c,)), matrix.reshape(c, k),
                              None if bias is None else bias.reshape(k))
    return (None, why) if y is None else (y.reshape(lead_shape + tuple(size[a] for a in features)), "")


def attention_on_kernels(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                         dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                         precision=None, module=None, promote_dtype=nnx_dtypes.promote_dtype,
                         is_causal=False):
    """``(y, "")``: ``flax.nnx.dot_product_attention``'s result (its arguments) on the kernels,
    through linen's adaptation (which takes grouped-query heads and ``is_causal`` to the
    kernels as they are), or ``(None, why not)``."""
    if promote_dtype is not nnx_dtypes.promote_dtype:
        return None, "custom promote_dtype"
    return jbnn.attention_on_kernels(
        query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
        dtype=dtype, precision=precision, module=module, is_causal=is_causal)


_MHA_CALL = ("inputs_q", "inputs_k", "inputs_v", "mask", "deterministic", "rngs",
             "sow_weights", "decode", "is_causal", "out_sharding", "qkv_sharding")


def multi_head_attention(module, next_call, args, kwargs):
    """``nnx.MultiHeadAttention``: its projections are LinearGeneral calls (their own rule);
    its attention runs on the kernels by handing the module, for this call, an
    ``attention_fn`` with the stock one's signature that computes on them (or runs the stock
    one and says why). The reason is None when an enclosing ``accelerate()`` context already
    handles the call."""
    fn = module.attention_fn
    if getattr(fn, "_jb_accelerate", False):
        return next_call(*args, **kwargs), None
    call = _bind(_MHA_CALL, args, kwargs)
    decode = module.decode if call is None or call.get("decode") is None else call["decode"]
    why = ("unexpected arguments" if call is None
           else "custom attention_fn" if fn is not stock_attention.dot_product_attention
           else "decode (the key / value cache)" if decode
           else "attention weights sown" if call.get("sow_weights") else "")
    with _named_sublayers(module):
        if why:
            return next_call(*args, **kwargs), why
        owner, outcome = threading.get_ident(), {}

        def attention_fn(query, key, value, **options):
            if threading.get_ident() == owner:  # another thread calling this module: stock
                y, outcome["why"] = attention_on_kernels(query, key, value, **options)
                if y is not None:
                    return y
            return fn(query, key, value, **options)

        attention_fn._jb_accelerate = True
        # Swapped for the call and restored; object.__setattr__ because the module may
        # belong to another trace level (e.g. closed over by jax.jit), where NNX refuses.
        object.__setattr__(module, "attention_fn", attention_fn)
        try:
            y = next_call(*args, **kwargs)
        finally:
            object.__setattr__(module, "attention_fn", fn)
    return y, outcome.get("why", "attention_fn not called")


@contextlib.contextmanager
def _named_sublayers(module):
    """Within a MultiHeadAttention call, in this thread, its projections are known by their
    attribute names (``enclosing``), so the report tells query, key and value apart."""
    names = getattr(_state, "names", None)
    if names is None:
        names = _state.names = {}
    own = {id(getattr(module, a)): (module, a) for a in ("query", "key", "value", "out")}
    saved = {i: names[i] for i in own if i in names}
    names.update(own)
    try:
        yield
    finally:
        for i in own:
            names.pop(i, None)
        names.update(saved)


def enclosing(module):
    """``(attention module, attribute name)`` when ``module`` is a projection of the
    MultiHeadAttention being called in this thread, else None."""
    names = getattr(_state, "names", None)
    return names.get(id(module)) if names else None


#: The stock classes these rules take (exactly these: a subclass may compute otherwise).
RULES = {
    stock_attention.MultiHeadAttention: multi_head_attention,
    stock_linear.LinearGeneral: linear_general,
    stock_linear.Einsum: einsum,
}
