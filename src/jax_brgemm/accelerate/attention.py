"""The rules of ``accelerate()`` for multi-head attention: linen's
``MultiHeadDotProductAttention`` (and its aliases) and NNX's ``MultiHeadAttention``.

Their projections are DenseGeneral / LinearGeneral calls, which their own rules take. Their
attention runs on the kernels by handing the module, for the one call, an ``attention_fn``
with the stock one's signature that computes on them (or runs the stock one and says why):
the stock module's own ``__call__`` does everything else, so no flax code is copied. The
field is put back when the call returns, and only the thread that swapped it computes on the
kernels through it.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import flax.linen as nn
from flax.nnx.nn import attention as stock_attention
from flax.nnx.nn import dtypes as nnx_dtypes

from jax_brgemm.accelerate.state import state
from jax_brgemm.accelerate.rules import _bind
from jax_brgemm.nn._adapt import Decision
from jax_brgemm.nn.attention import attention_on_kernels

#: MultiHeadDotProductAttention and Flax's own aliases of it.
LINEN_MODULES = (nn.MultiHeadDotProductAttention, nn.MultiHeadAttention, nn.SelfAttention)

_MHA_CALL = ("inputs_q", "inputs_k", "inputs_v", "mask", "deterministic", "rngs",
             "sow_weights", "decode", "is_causal", "out_sharding", "qkv_sharding")


def _with_attention_on_kernels(module, stock_fn, on_kernels, run, decided) -> Decision:
    """``Decision(run() (the stock call), why not)`` with ``module.attention_fn`` computing
    ``on_kernels(query, key, value, **options)`` (a Decision; ``stock_fn`` where not taken)
    during the call; ``decided(why)`` is called when the attention runs."""
    owner, outcome = threading.get_ident(), {}

    def attention_fn(query, key, value, **options):
        if threading.get_ident() != owner:  # another thread calling the same module
            return stock_fn(query, key, value, **options)
        y, why = on_kernels(query, key, value, **options)
        outcome["why"] = why
        decided(why)
        return stock_fn(query, key, value, **options) if why else y

    attention_fn._jb_accelerate = True
    attention_fn.__signature__ = inspect.signature(stock_fn)  # the stock module filters by it
    # object.__setattr__: a frozen linen dataclass; an NNX module of another trace level
    object.__setattr__(module, "attention_fn", attention_fn)
    try:
        y = run()
    finally:
        object.__setattr__(module, "attention_fn", stock_fn)
    if "why" not in outcome:
        decided("attention_fn not called")
    return Decision(y, outcome.get("why", "attention_fn not called"))


def linen_attention(module, args, kwargs, next_call, decided):
    """The attention of a linen MultiHeadDotProductAttention call; None for the call an
    enclosing one of the same module makes (SelfAttention's ``super().__call__``)."""
    if getattr(module.attention_fn, "_jb_accelerate", False):
        return None
    why = ("custom attention_fn" if module.attention_fn is not nn.dot_product_attention
           else "decode (the key / value cache)" if module.decode
           else "custom einsum" if module.qk_attn_weights_einsum_cls or module.attn_weights_value_einsum_cls
           else "attention weights sown" if kwargs.get("sow_weights") else "")
    if why:
        decided(why)
        return Decision.stock(why)
    return _with_attention_on_kernels(module, nn.dot_product_attention, attention_on_kernels,
                                      lambda: next_call(*args, **kwargs), decided)


def _nnx_on_kernels(query, key, value, promote_dtype=nnx_dtypes.promote_dtype, **options):
    """``flax.nnx.dot_product_attention``'s arguments on linen's adaptation (which takes
    grouped-query heads and ``is_causal`` to the kernels as they are)."""
    if promote_dtype is not nnx_dtypes.promote_dtype:
        return Decision.stock("custom promote_dtype")
    return attention_on_kernels(query, key, value, **options)


def nnx_attention(module, args, kwargs, next_call, decided):
    """The attention of an NNX MultiHeadAttention call; its projections are named by
    their attributes in the report while it runs."""
    fn = module.attention_fn
    if getattr(fn, "_jb_accelerate", False):
        return None
    call = _bind(_MHA_CALL, args, kwargs)
    decode = module.decode if call is None or call.get("decode") is None else call["decode"]
    why = ("unexpected arguments" if call is None
           else "custom attention_fn" if fn is not stock_attention.dot_product_attention
           else "decode (the key / value cache)" if decode
           else "attention weights sown" if call.get("sow_weights") else "")
    with _named_sublayers(module):
        if why:
            decided(why)
            return Decision(next_call(*args, **kwargs), why)
        ran = _with_attention_on_kernels(module, fn, _nnx_on_kernels,
                                         lambda: next_call(*args, **kwargs), lambda why: None)
    decided(ran.reason)  # NNX reports the attention after its projections
    return ran


@contextlib.contextmanager
def _named_sublayers(module):
    """Within a MultiHeadAttention call, in this thread, its projections are known by their
    attribute names (``enclosing``), so the report tells query, key and value apart."""
    names = state.sublayers
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
    return state.sublayers.get(id(module))

