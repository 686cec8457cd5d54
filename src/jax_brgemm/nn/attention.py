"""The Transformer layers of ``flax.linen`` on the kernels: Flax's ``dot_product_attention``
on the attention kernels (a drop-in ``attention_fn`` for ``MultiHeadDotProductAttention``),
and ``DenseGeneral`` over trailing axes (its projections) on the FC kernels; what
``jax_brgemm.accelerate()`` runs those modules with. ``MultiHeadDotProductAttention`` is
the stock module with both built in."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_brgemm.nn import _adapt
from jax_brgemm.nn._adapt import Decision
from jax_brgemm.nn.linear import dense_on_kernels
from jax_brgemm.ops.attention import dot_product_attention as _attention

def attention_on_kernels(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                         dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                         force_fp32_for_softmax=False, einsum_dot_general=None, qk_attn_weights_einsum=None,
                         attn_weights_value_einsum=None, *, is_causal=False):
    """``flax.linen.dot_product_attention``'s result on the kernels (its arguments), as a
    ``Decision``.

    The kernels take float32 or bfloat16 computations, attention dropout included (the same
    weights dropped as Flax drops for the same ``dropout_rng``), without custom einsums or
    ``einsum_dot_general``, and without a ``module`` to sow the attention weights into (the
    kernels never form them). The softmax is always float32 (Flax's is in the computation
    dtype unless ``force_fp32_for_softmax``), and so is the dropout's 1 / keep_prob;
    ``precision`` is computed as ``jax_brgemm.precision`` says.
    """
    del force_fp32_for_softmax
    why = _adapt.precision_why(precision)
    if why:
        return Decision.stock(why)
    dropout = not deterministic and _rate(dropout_rate) != 0.0
    if dropout and (_rate(dropout_rate) is None or not 0.0 < dropout_rate < 1.0):
        return Decision.stock("dropout_rate not a number in [0, 1)")
    if dropout and dropout_rng is None:
        return Decision.stock("attention dropout without dropout_rng")
    if module is not None:
        return Decision.stock("attention weights sown")
    if einsum_dot_general is not None or qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        return Decision.stock("custom einsum")
    dtype, why = _adapt.computation_dtype(dtype, query, key, value)
    if dtype is None:
        return Decision.stock(why)
    # key / value heads may divide the query's (grouped-query attention, as the kernels take it)
    if not (query.ndim == key.ndim == value.ndim >= 3) or key.shape != value.shape or (
            query.shape[:-3] != key.shape[:-3] or query.shape[-1] != key.shape[-1]
            or not key.shape[-2] or query.shape[-2] % key.shape[-2]):
        return Decision.stock("query, key and value shapes")
    batch = query.shape[:-3]
    lead = int(np.prod(batch, dtype=np.int64))
    q, k, v = (jnp.asarray(a, dtype).reshape((lead,) + a.shape[-3:]) for a in (query, key, value))
    full = batch + (query.shape[-2], query.shape[-3], key.shape[-3])  # (..., N, T, S)
    operands = []
    for name, a in (("bias", bias), ("mask", mask)):
        if a is not None:
            a = _batch_folded(jnp.asarray(a), full, lead)
            if a is None:
                return Decision.stock(f"{name} does not broadcast to the attention weights")
            operands.append(a.astype(bool) if name == "mask" else a)
        else:
            operands.append(None)
    # the same bits as Flax's: bernoulli of its shape, whose batch dims folded draw the same
    drop = dict(dropout_rate=float(dropout_rate), dropout_rng=dropout_rng,
                broadcast_dropout=bool(broadcast_dropout)) if dropout else {}
    y = _attention(q, k, v, *operands, is_causal=is_causal, precision=precision, **drop)
    return Decision(y.reshape(query.shape))


def _rate(rate):
    """A dropout rate as a Python float, None if it is not one (a tracer)."""
    try:
        return float(rate)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def _batch_folded(a, full, lead):
    """``a``, broadcastable to ``full`` = (batch..., N, T, S), as (lead or 1, n, t, s)."""
    if a.ndim > len(full):
        return None
    a = a.reshape((1,) * (len(full) - a.ndim) + a.shape)
    if any(d != 1 and d != f for d, f in zip(a.shape, full)):
        return None
    nb = len(full) - 3
    if all(d == 1 for d in a.shape[:nb]):
        return a.reshape((1,) + a.shape[nb:])
    return jnp.broadcast_to(a, full[:nb] + a.shape[nb:]).reshape((lead,) + a.shape[nb:])


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                          dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                          force_fp32_for_softmax=False, einsum_dot_general=None, qk_attn_weights_einsum=None,
                          attn_weights_value_einsum=None):
    """``flax.linen.dot_product_attention`` (the same signature) on the kernels where they
    take the call (see ``attention_on_kernels``), else Flax's own: an ``attention_fn`` for
    ``flax.linen.MultiHeadDotProductAttention``."""
    args = dict(bias=bias, mask=mask, broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
                dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype, precision=precision,
                module=module, force_fp32_for_softmax=force_fp32_for_softmax,
                einsum_dot_general=einsum_dot_general, qk_attn_weights_einsum=qk_attn_weights_einsum,
                attn_weights_value_einsum=attn_weights_value_einsum)
    y, _ = attention_on_kernels(query, key, value, **args)
    return nn.dot_product_attention(query, key, value, **args) if y is None else y


def dense_general_on_kernels(layer, inputs, kernel, bias, *, stays_stock=None):
    """A ``flax.linen.DenseGeneral`` call on the FC kernels, as a ``Decision``.
    Contracting the input's trailing axes (the attention's projections, (..., C) ->
    (..., N, H) and (..., N, H) -> (..., C)) it is a Dense over those axes flattened, with
    the kernel and bias reshaped; ``batch_dims`` and other axes are not taken."""
    if layer.batch_dims:
        return Decision.stock("batch_dims")
    axes = sorted(a % inputs.ndim for a in (layer.axis if isinstance(layer.axis, tuple) else (layer.axis,)))
    if not axes or axes != list(range(inputs.ndim - len(axes), inputs.ndim)):
        return Decision.stock("contracting axes other than the input's last ones")
    features = layer.features if isinstance(layer.features, tuple) else (layer.features,)
    contracted = inputs.shape[axes[0]:]
    if kernel.shape != contracted + features:
        return Decision.stock("parameter shapes do not match the inputs")
    c, k = int(np.prod(contracted, dtype=np.int64)), int(np.prod(features, dtype=np.int64))
    lead = inputs.shape[:axes[0]]
    y, why = dense_on_kernels(layer, inputs.reshape(lead + (c,)), kernel.reshape(c, k),
                              None if bias is None else bias.reshape(k), stays_stock=stays_stock)
    return Decision.stock(why) if why else Decision(y.reshape(lead + features))


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
    """``flax.linen.MultiHeadDotProductAttention`` on the kernels: its attention on
    ``jb.dot_product_attention`` (``attention_fn`` defaults to this module's
    ``dot_product_attention``) and its query / key / value / output projections on the FC
    kernels.

    The same fields, call and parameters as the stock module (it is a subclass), so a
    checkpoint of either loads into the other. Attention dropout drops the weights the stock
    module drops. What the kernels do not take computes as the stock module does:
    ``sow_weights``, custom einsums, a float16 / float64
    computation (see ``attention_on_kernels``), and for a projection a custom
    ``dot_general``. ``decode`` caches work as in the stock module, with the attention on the
    kernels. The softmax is float32 (Flax's is in the computation dtype).
    """

    attention_fn: Callable[..., Any] = dot_product_attention

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
                 deterministic=None, dropout_rng=None, sow_weights=False):
        with nn.intercept_methods(_projections_on_kernels(self)):
            return super().__call__(inputs_q, inputs_k, inputs_v, inputs_kv=inputs_kv, mask=mask,
                                    deterministic=deterministic, dropout_rng=dropout_rng,
                                    sow_weights=sow_weights)


def _projections_on_kernels(owner):
    """A method interceptor running ``owner``'s own DenseGeneral children (its projections) on
    the FC kernels once their parameters exist; every other call passes through."""

    def intercept(next_fun, args, kwargs, context):
        layer = context.module
        if (type(layer) is not nn.DenseGeneral or context.method_name != "__call__"
                or layer.parent is not owner or layer.is_initializing() or len(args) != 1 or kwargs):
            return next_fun(*args, **kwargs)
        params = layer.variables.get("params", {})
        if "kernel" not in params or (layer.use_bias and "bias" not in params):
            return next_fun(*args, **kwargs)
        y, _ = dense_general_on_kernels(layer, args[0], params["kernel"], params.get("bias"))
        return next_fun(*args, **kwargs) if y is None else y

    return intercept
