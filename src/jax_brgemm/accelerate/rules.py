"""The rules of ``accelerate()`` for the linear layers: which stock call runs on which op, on
what condition; linen's and NNX's side by side, sharing the adaptation of ``jax_brgemm.nn``.

A rule takes the stock module and its call's ``(args, kwargs)`` and returns a ``Decision``:
the result on the kernels, or why the stock code computes it. The table of every rule is
``dispatch.LINEN_RULES`` / ``dispatch.NNX_RULES``.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import opt_einsum
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from jax_brgemm.accelerate import policy
from jax_brgemm.accelerate.state import options
from jax_brgemm.nn import _adapt
from jax_brgemm.nn._adapt import Decision
from jax_brgemm.nn.attention import dense_general_on_kernels
from jax_brgemm.nn.conv import conv_on_kernels, conv_transpose_on_kernels
from jax_brgemm.nn.linear import dense_on_kernels
from jax_brgemm.nnx.linear import kernel_and_bias
from jax_brgemm.ops.dense import attend


def _policy(dtype, rows: int) -> str:
    """Why the dispatch policy of this thread's context leaves a dense-like call of ``rows``
    rows in ``dtype`` to stock XLA ("" when it does not)."""
    opts = options()
    return policy.stock_reason("dense", dtype, rows) if opts is not None and opts.policy else ""


def linen_params(module, args, kwargs, arguments=(1, 1), keywords=()) -> Decision:
    """``Decision((kernel, bias))`` of a linen Dense-like layer called with one input (or
    ``arguments`` = (least, most) positional ones) and only ``keywords``."""
    params = module.variables.get("params", {})
    least, most = arguments
    if not least <= len(args) <= most or set(kwargs) - set(keywords) or not hasattr(args[0], "ndim"):
        return Decision.stock("unexpected arguments")
    if "kernel" not in params or (module.use_bias and "bias" not in params):
        return Decision.stock("parameters not created yet")
    return Decision((params["kernel"], params.get("bias")))


def _bind(names, args, kwargs) -> dict | None:
    """The call's arguments by name (``names`` in the stock signature's order), or None for
    arguments the stock signature does not have."""
    if len(args) > len(names) or set(kwargs) - set(names[len(args):]):
        return None
    return {**dict(zip(names, args)), **kwargs}


def _nnx_call(module, args, kwargs, names=("inputs", "out_sharding")) -> Decision:
    """``Decision(the call's arguments by name)`` of an NNX layer taking ``names[0]``."""
    call = _bind(names, args, kwargs)
    if call is None or not hasattr(call.get(names[0]), "ndim"):
        return Decision.stock("unexpected arguments")
    if call.get("out_sharding") is not None:
        return Decision.stock("out_sharding")
    return Decision(call)


# --- Dense / Linear and Conv ----------------------------------------------------------------


def _linen_rule(on_kernels, **options):
    """The rule of a linen layer called on one input, computed on the kernels by
    ``on_kernels(module, inputs, kernel, bias, **options)``."""

    def rule(module, args, kwargs):
        params = linen_params(module, args, kwargs)
        return on_kernels(module, args[0], *params.value, **options) if params.taken else params

    return rule


linen_dense = _linen_rule(dense_on_kernels, stays_stock=_policy)
linen_conv = _linen_rule(conv_on_kernels)
linen_conv_transpose = _linen_rule(conv_transpose_on_kernels)
linen_dense_general = _linen_rule(dense_general_on_kernels, stays_stock=_policy)


def _nnx_one_input(module, args, kwargs, spatial: int = 0, names=("inputs", "out_sharding")) -> Decision:
    call = _nnx_call(module, args, kwargs, names)
    if not call.taken:
        return call
    shape = call.value["inputs"].shape
    if len(shape) < 1 + spatial or shape[-1] != module.in_features:
        return Decision.stock("inputs do not match in_features")
    return call


def nnx_linear(module, args, kwargs):
    call = _nnx_one_input(module, args, kwargs)
    if not call.taken:
        return call
    return dense_on_kernels(module, call.value["inputs"], *kernel_and_bias(module),
                            stays_stock=_policy)


def nnx_conv(module, args, kwargs):
    call = _nnx_one_input(module, args, kwargs, spatial=len(module.kernel_size))
    return conv_on_kernels(module, call.value["inputs"], *kernel_and_bias(module)) if call.taken else call


def nnx_conv_transpose(module, args, kwargs):
    call = _nnx_one_input(module, args, kwargs, spatial=len(module.kernel_size), names=("inputs",))
    if not call.taken:
        return call
    return conv_transpose_on_kernels(module, call.value["inputs"], *kernel_and_bias(module))


# --- DenseGeneral / LinearGeneral and Einsum --------------------------------------------------


def linen_view(module, **fields):
    """An NNX ``LinearGeneral`` / ``Einsum`` (or a linen ``Einsum``) with the fields of a
    linen Dense, as the linen adaptations read them: ``dot_general`` None for the stock
    product, ``promote_dtype`` called with the arrays as separate arguments."""
    promote = module.promote_dtype
    if isinstance(module, nnx.Module) and promote is not nnx_dtypes.promote_dtype:
        promote = lambda *arrays, dtype: module.promote_dtype(arrays, dtype=dtype)  # noqa: E731
    return types.SimpleNamespace(
        dtype=module.dtype, promote_dtype=promote, precision=getattr(module, "precision", None),
        preferred_element_type=getattr(module, "preferred_element_type", None),
        dot_general=getattr(module, "dot_general", None),
        dot_general_cls=getattr(module, "dot_general_cls", None), **fields)


def nnx_linear_general(module, args, kwargs):
    """Over the input's trailing axes, without ``batch_axis``: linen's DenseGeneral."""
    call = _nnx_call(module, args, kwargs)
    if not call.taken:
        return call
    if module.batch_axis:
        return Decision.stock("batch_axis")
    view = linen_view(module, batch_dims=(), axis=module.axis, features=module.out_features)
    return dense_general_on_kernels(view, call.value["inputs"], *kernel_and_bias(module),
                                    stays_stock=_policy)


def linen_einsum(module, args, kwargs):
    params = linen_params(module, args, kwargs, arguments=(1, 2), keywords=("einsum_str",))
    if not params.taken:
        return params
    spec = args[1] if len(args) == 2 else kwargs.get("einsum_str")
    if (spec is None) == (module.einsum_str is None):
        return Decision.stock("einsum_str given twice or not at all")
    return einsum_on_kernels(linen_view(module), spec or module.einsum_str, args[0], *params.value,
                             stays_stock=_policy)


def nnx_einsum(module, args, kwargs):
    call = _nnx_call(module, args, kwargs, names=("inputs", "einsum_str", "out_sharding"))
    if not call.taken:
        return call
    if module.einsum_op is not jnp.einsum:
        return Decision.stock("custom einsum_op")
    spec = call.value.get("einsum_str") or module.einsum_str
    return einsum_on_kernels(linen_view(module), spec, call.value["inputs"], *kernel_and_bias(module),
                             stays_stock=_policy)


def einsum_on_kernels(layer, spec, inputs, kernel, bias, *, stays_stock=None) -> Decision:
    """An Einsum layer's ``spec`` (``"input,kernel->output"``) of ``inputs`` and ``kernel``
    plus ``bias`` on the FC kernels. ``layer`` has a linen Dense's dtype fields
    (``linen_view``).

    Taken when it is a matrix product: the kernel's axes are the contracted ones, which end
    the input (in any order), and the features, which end the output (in any order), after
    the input's other axes in their order; e.g. ``"...d,dnh->...nh"`` or ``"btnh,nhd->btd"``.
    The kernel is transposed to that order (a parameter-sized copy) and the rest reshaped.
    """
    if not isinstance(spec, str):
        return Decision.stock("unexpected arguments")
    try:
        operands, out, _ = opt_einsum.parser.parse_einsum_input((spec.replace(" ", ""), inputs,
                                                                  kernel))
    except (ValueError, TypeError, IndexError):  # the stock call raises it again
        return Decision.stock("einsum_str")
    x_axes, k_axes = operands.split(",")
    if any(len(set(s)) != len(s) for s in (x_axes, k_axes, out)):
        return Decision.stock("an axis repeated within an operand")
    if set(x_axes) & set(k_axes) & set(out):
        return Decision.stock("axes of the input, kernel and output (a batched product)")
    if (set(x_axes) | set(k_axes)) - set(out) != set(x_axes) & set(k_axes):
        return Decision.stock("axes summed out of one operand alone")
    lead = [a for a in x_axes if a not in k_axes]
    contracted = x_axes[len(lead):]
    features = out[len(lead):]
    if not contracted or list(x_axes[:len(lead)]) != lead:
        return Decision.stock("contracting axes other than the input's last ones")
    if list(out[:len(lead)]) != lead:
        return Decision.stock("output axes other than the input's others, then the features")
    if inputs.ndim != len(x_axes) or kernel.ndim != len(k_axes):
        return Decision.stock("parameter shapes do not match the inputs")
    size = dict(zip(k_axes, kernel.shape))
    if any(size[a] != d for a, d in zip(contracted, inputs.shape[len(lead):])):
        return Decision.stock("parameter shapes do not match the inputs")
    c = int(np.prod([size[a] for a in contracted], dtype=np.int64))
    k = int(np.prod([size[a] for a in features], dtype=np.int64))
    if bias is not None and bias.size != k:
        return Decision.stock("bias shape")
    matrix = jnp.transpose(kernel, [k_axes.index(a) for a in contracted + features])
    lead_shape = inputs.shape[:len(lead)]
    y, why = dense_on_kernels(layer, inputs.reshape(lead_shape + (c,)), matrix.reshape(c, k),
                              None if bias is None else bias.reshape(k), stays_stock=stays_stock)
    return Decision.stock(why) if why else Decision(y.reshape(lead_shape + tuple(size[a] for a in features)))


# --- Embed.attend: a tied embedding's logits ----------------------------------------------


def _attend_on_kernels(module, query, embedding) -> Decision:
    """``query @ embedding.T`` on the FC kernels (``jb.ops.dense.attend``: the table read as it
    is stored), in the module's computation dtype."""
    if not hasattr(query, "ndim") or query.ndim < 1 or query.shape[-1] != embedding.shape[-1]:
        return Decision.stock("query does not match the embedding's features")
    operands = _adapt.kernel_operands(module, query, embedding, None)
    if not operands.taken:
        return operands
    query, embedding, _, dtype = operands.value
    why = _policy(dtype, int(np.prod(query.shape[:-1])))
    return Decision.stock(why) if why else Decision(attend(query, embedding, dtype=dtype))


def linen_embed_attend(module, args, kwargs):
    if len(args) != 1 or kwargs:
        return Decision.stock("unexpected arguments")
    params = module.variables.get("params", {})
    if "embedding" not in params:
        return Decision.stock("parameters not created yet")
    return _attend_on_kernels(module, args[0], params["embedding"])


def nnx_embed_attend(module, args, kwargs):
    call = _nnx_call(module, args, kwargs, names=("query", "out_sharding"))
    if not call.taken:
        return call
    return _attend_on_kernels(module, call.value["query"], module.embedding[...])
