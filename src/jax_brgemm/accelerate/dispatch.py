"""The rule table of ``accelerate()`` (which stock layer, which rule) and the one path from a
rule's ``Decision`` to the call's result and the report: for linen's method interceptor, for
NNX's calls and for the methods ``nn.scan`` made (``patches`` routes those here).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp
from flax.nnx.nn import attention as nnx_attention
from flax.nnx.nn import linear as nnx_linear
from flax.nnx.nn import recurrent as nnx_recurrent

from jax_brgemm import precision as jb_precision
from jax_brgemm.accelerate import attention, recurrent, rules
from jax_brgemm.accelerate.state import in_stock_scan, options, record, stock_scan
from jax_brgemm.ops import eltwise, random

#: Stock linen class -> rule (exactly these classes: a subclass may compute otherwise).
LINEN_RULES = {
    nn.Dense: rules.linen_dense,
    nn.Conv: rules.linen_conv,
    nn.ConvTranspose: rules.linen_conv_transpose,
    nn.DenseGeneral: rules.linen_dense_general,
    nn.Einsum: rules.linen_einsum,
    nn.RNN: recurrent.linen_rnn,
    **{cls: attention.linen_attention for cls in attention.LINEN_MODULES},
}
#: Stock NNX class -> rule, likewise.
NNX_RULES = {
    nnx_linear.Linear: rules.nnx_linear,
    nnx_linear.Conv: rules.nnx_conv,
    nnx_linear.ConvTranspose: rules.nnx_conv_transpose,
    nnx_linear.LinearGeneral: rules.nnx_linear_general,
    nnx_linear.Einsum: rules.nnx_einsum,
    nnx_recurrent.RNN: recurrent.nnx_rnn,
    nnx_attention.MultiHeadAttention: attention.nnx_attention,
}
#: Methods other than ``__call__``: (stock class, method) -> rule.
LINEN_METHOD_RULES = {(nn.Embed, "attend"): rules.linen_embed_attend}
NNX_METHOD_RULES = {(nnx_linear.Embed, "attend"): rules.nnx_embed_attend}
# Rules that run the stock call themselves (with the attention swapped in): given next_call
# and a function recording their decision when it is made, in the middle of the call.
_RUN_STOCK = {attention.linen_attention, attention.nnx_attention}

#: Stock recurrent cells. Called by anything but an intercepted RNN or scan (a loop, another
#: transform), the layers inside them are per-step work, which the report says.
LINEN_CELLS = (nn.OptimizedLSTMCell, nn.LSTMCell, nn.GRUCell, nn.SimpleCell, nn.MGUCell,
               nn.ConvLSTMCell)
NNX_CELLS = (nnx_recurrent.OptimizedLSTMCell, nnx_recurrent.LSTMCell, nnx_recurrent.GRUCell,
             nnx_recurrent.SimpleCell)
#: The NNX classes whose ``__call__`` is routed here inside a context.
NNX_CLASSES = (*NNX_RULES, *NNX_CELLS)


def _run(rule, module, where: str, layer: str, args, kwargs, next_call, scan: str = ""):
    """The call's result by ``rule``, recorded at ``where`` as ``layer``; the stock call where
    the rule leaves it, marked as the stock scan ``scan`` when one is named."""
    # bfloat16 computations are exact float32 whatever the precision (one product is exact)
    dtype = getattr(module, "dtype", None) or getattr(args[0] if args else None, "dtype", None)
    note = _precision(module, exact=dtype == jnp.bfloat16)
    if rule in _RUN_STOCK:
        decision = rule(module, args, kwargs, next_call, lambda why: record(where, layer, why, note))
    else:
        decision = rule(module, args, kwargs)
        record(where, layer, decision.reason, note)
    if decision is None:  # an enclosing call of the same module decides
        return next_call(*args, **kwargs)
    if decision.value is not None:
        return decision.value
    if scan:  # a stock recurrent scan: its cell's layers run on the kernels once per step
        with stock_scan(f"{where or '<top>'} [{scan}]", decision.reason):
            return next_call(*args, **kwargs)
    return next_call(*args, **kwargs)


def _precision(module, exact: bool) -> str:
    """For the report: the accuracy the layer's ``precision`` (or
    ``jax.default_matmul_precision``) asks and the one its kernels compute, unless float32."""
    try:
        asked = jb_precision.accuracy(getattr(module, "precision", None), "")
    except ValueError:  # the rule leaves the call stock, saying why
        return ""
    if asked == "float32":
        return ""
    computed = "float32" if exact else jb_precision.computed(asked, type(module).__name__)
    return f"precision {asked}, computed {computed}"


def _step_by_step(where: str, scan: str, layer: str, fused: str, next_call, args, kwargs):
    """A recurrent cell called by something other than an intercepted RNN or scan: the stock
    scan ``scan`` (what ``fused`` says runs fused instead)."""
    why = f"{layer} called step by step"
    record(where, layer, f"{why}; {fused}")
    with stock_scan(scan, why):
        return next_call(*args, **kwargs)


def linen_call(next_fun, args, kwargs, context):
    """linen's interceptor (``nn.intercept_methods``) inside a context."""
    module = context.module
    if options() is None or module.scope is None or module.is_initializing():
        return next_fun(*args, **kwargs)  # parameters are created by the stock code
    cls = type(module)
    where = "/".join(module.scope.path)
    if context.method_name != "__call__":
        rule = LINEN_METHOD_RULES.get((cls, context.method_name))
        if rule is None:
            return next_fun(*args, **kwargs)
        return _run(rule, module, where, f"{cls.__name__}.{context.method_name}", args, kwargs, next_fun)
    rule = LINEN_RULES.get(cls)
    if rule is not None:
        scan = f"RNN over {type(module.cell).__name__}" if cls is nn.RNN else ""
        return _run(rule, module, where, cls.__name__, args, kwargs, next_fun, scan)
    if cls in LINEN_CELLS and not in_stock_scan():
        return _step_by_step(where, f"{where or '<top>'} [{cls.__name__}]", cls.__name__,
                             "nn.RNN and nn.scan over OptimizedLSTMCell / LSTMCell, or over a "
                             "method calling one, are fused", next_fun, args, kwargs)
    return next_fun(*args, **kwargs)


def nnx_call(module, next_call, args, kwargs):
    """The call of a routed NNX class's instance inside a context."""
    cls = type(module)
    rule = NNX_RULES.get(cls)
    if rule is not None:
        scan = f"RNN over {type(module.cell).__name__}" if cls is nnx_recurrent.RNN else ""
        return _run(rule, module, describe(module), cls.__name__, args, kwargs, next_call, scan)
    if cls in NNX_CELLS and not in_stock_scan():
        return _step_by_step(describe(module), describe(module), cls.__name__,
                             "nnx.RNN over OptimizedLSTMCell / LSTMCell is fused", next_call, args, kwargs)
    return next_call(*args, **kwargs)


def nnx_method_call(method: str):
    """The handler of an NNX class's routed ``method`` (``NNX_METHOD_RULES``) in a context."""

    def call(module, next_call, args, kwargs):
        rule = NNX_METHOD_RULES[(type(module), method)]
        return _run(rule, module, describe(module), f"{type(module).__name__}.{method}", args, kwargs, next_call)

    return call


#: Elements from which gelu's derivative runs on the kernels under accelerate().
_GELU_MIN_SIZE = 1 << 14


def gelu_call(stock_gelu):
    """What ``jax.nn.gelu`` (and flax's names for it) is while a context is open: the tanh
    approximation of a float32 / bfloat16 array of at least ``_GELU_MIN_SIZE`` elements with
    its derivative on the kernels (``ops.eltwise.gelu``) in a thread inside a context, else
    ``stock_gelu`` itself."""

    @functools.wraps(stock_gelu)
    def gelu(x, approximate=True):
        # the erf form, other dtypes and small arrays (XLA's fused derivative is as fast
        # there) stay jax's, unreported: a function, not a layer
        if (options() is None or approximate is not True or not hasattr(x, "dtype")
                or jnp.dtype(x.dtype) not in (jnp.float32, jnp.bfloat16) or x.size < _GELU_MIN_SIZE):
            return stock_gelu(x, approximate)
        record("", "jax.nn.gelu", "")
        return eltwise.gelu(x)

    return gelu


def bernoulli_call(stock_bernoulli):
    """What ``jax.random.bernoulli`` is while a context is open: the same booleans drawn on
    the kernels (``ops.random.bernoulli``: dropout's masks, flax's included) in a thread
    inside a context where they hash like JAX's, else ``stock_bernoulli`` itself."""

    @functools.wraps(stock_bernoulli)
    def bernoulli(key, p=0.5, shape=None, mode="low", **kwargs):
        if options() is None or shape is None or mode != "low" or kwargs.get("out_sharding") is not None:
            return stock_bernoulli(key, p, shape, mode, **kwargs)
        if not random.hashes_like_jax(key, p):  # jax's own, unreported (a function, not a layer)
            return stock_bernoulli(key, p, shape, mode, **kwargs)
        record("", "jax.random.bernoulli", "")
        return random.bernoulli(key, p, shape)

    return bernoulli


def scan_call(module, scan, next_call, args, kwargs):
    """The call of a method ``nn.scan`` made (``scans.Scan``) inside a context."""
    if module.scope is None or module.is_initializing():  # parameters: the stock code's
        return next_call(*args, **kwargs)
    layer = (f"nn.scan({scan.cell_class.__name__})" if scan.cell_class is not None
             else f"nn.scan({type(module).__name__}.{scan.name})")
    return _run(lambda m, a, k: recurrent.linen_scan(m, scan, a, k), module, "/".join(module.scope.path),
                layer, args, kwargs, next_call, scan=layer)


def describe(module) -> str:
    """A name for an NNX layer in a report (NNX modules do not know their path): the class
    and its sizes, e.g. ``nnx.Linear(784 -> 128)``; a projection of a MultiHeadAttention
    being called, by its attribute, e.g. ``nnx.MultiHeadAttention(4 heads, 32 -> 32)/query``."""
    parent = attention.enclosing(module)
    if parent is not None:
        return f"{describe(parent[0])}/{parent[1]}"
    name = f"nnx.{type(module).__name__}"
    if isinstance(module, nnx_recurrent.RNN):
        return f"{name}({describe(module.cell)})"
    if isinstance(module, nnx_linear.Einsum):
        return f"{name}({module.einsum_str!r})"
    sizes = [getattr(module, a, None) for a in ("in_features", "out_features", "hidden_features")]
    text = " -> ".join("x".join(map(str, v)) if isinstance(v, tuple) else str(v)
                       for v in sizes if v is not None)
    if isinstance(module, (nnx_linear.Conv, nnx_linear.ConvTranspose)):
        text += f", kernel {tuple(module.kernel_size)}"
    if isinstance(module, nnx_attention.MultiHeadAttention):
        text = f"{module.num_heads} heads, {text}"
    if isinstance(module, nnx_linear.Embed):
        text = f"{module.num_embeddings} x {module.features}"
    return f"{name}({text})"
