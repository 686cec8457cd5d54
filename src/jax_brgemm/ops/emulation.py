"""float32 matrix products from bfloat16 ones: the multi-product emulation of
``jax_brgemm.precision`` as one batch-reduce.

Each float32 operand is split into bfloat16 parts (``hi = bf16(x)``, ``mid = bf16(x - hi)``,
...). A product of bfloat16 parts is exact in float32, so ``a @ b`` is the sum of the part
products, of which the large ones are kept (Henry, Tang, Heinecke, ARITH 2019): three for
``bf16_3x`` (hi.hi + hi.mid + mid.hi), six for ``bf16_6x`` (a third part, lo, adds
mid.mid + hi.lo + lo.hi), one for ``bf16``. Those products are one more batch-reduce over
the (term, i) pairs, so a single call accumulates every product of a tile into the same
float32 accumulators. Every kernel splits its operands itself where it copies or re-blocks
them (the ``products`` attr of jb.brgemm, the FC, convolution, attention and LSTM passes);
``split`` here is the same split in XLA, for the tests. The derivatives (the passes' JVP
and transpose rules) are emulated products at the same accuracy.

An infinite operand is the one input whose parts cannot carry float32's result: its high
part times the other operand's low part (zero, or of the other sign) gives NaN where the
float32 product is infinite; so are finite values beyond bfloat16's largest, whose high part
rounds to an infinity. ``exact_on_infinity`` makes every op compute exact float32 products
when an operand holds one.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from jax_brgemm import precision as _precision

#: accuracy -> the (part of a, part of b) products summed.
TERMS = {
    "bf16": ((0, 0),),
    "bf16_3x": ((0, 1), (1, 0), (0, 0)),
    "bf16_6x": ((1, 1), (0, 2), (2, 0), (0, 1), (1, 0), (0, 0)),
}


def split(x, parts: int):
    """``x`` (float32) as ``parts`` bfloat16 arrays whose float32 sum approximates it, largest
    first: each the bfloat16 rounding of what the previous ones leave."""
    out = []
    rest = x.astype(jnp.float32)
    for _ in range(parts):
        out.append(rest.astype(jnp.bfloat16))
        rest = rest - out[-1].astype(jnp.float32)
    return out


_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


def _beyond_in_xla(a):
    return jnp.any(jnp.abs(a) > _BF16_MAX)


@jax.custom_batching.custom_vmap
def _beyond(*arrays):
    f32 = [a for a in arrays if a.dtype == jnp.float32]  # read by the kernel, both cores
    flags = [_beyond_in_xla(a) for a in arrays if a.dtype != jnp.float32]
    if f32:
        flags.append(jax.ffi.ffi_call("jb_beyond_bf16", jax.ShapeDtypeStruct((), jnp.bool_))(*f32))
    return functools.reduce(jnp.logical_or, flags)


@_beyond.def_vmap
def _beyond_per_item(axis_size, batched, *arrays):
    """Under vmap, each item's own answer (so that only items with an infinity run exactly)."""
    flags = [jnp.any(jnp.abs(a.reshape(axis_size, -1)) > _BF16_MAX, axis=1) if b else
             jnp.broadcast_to(_beyond(a), (axis_size,)) for a, b in zip(arrays, batched)]
    return functools.reduce(jnp.logical_or, flags), True


def beyond_bf16(*arrays):
    """Whether any value of ``arrays`` (floating) is an infinity or beyond bfloat16's largest
    finite value, the values whose bfloat16 parts cannot carry float32's product. A scalar
    bool (per item under vmap)."""
    return _beyond(*(jax.lax.stop_gradient(a) for a in arrays))


def exact_on_infinity(*names):
    """Decorates an op that takes ``precision=``: where it would emulate float32 products
    and one of its arguments ``names`` (arrays, or pytrees of them) holds an infinity (or a
    value beyond bfloat16's largest), it runs with ``precision="highest"`` instead, so
    infinities propagate as in float32 (NaN needs nothing). A ``lax.cond`` on the operands:
    under vmap both branches run."""
    def decorate(op):
        signature = inspect.signature(op)

        @functools.wraps(op)
        def run(*args, **kwargs):
            try:
                call = signature.bind(*args, **kwargs)
                emulated = _precision.computed(_precision.accuracy(call.arguments.get("precision"), op.__name__),
                                              op.__name__)
            except (TypeError, ValueError):  # the op names the bad argument itself
                return op(*args, **kwargs)
            leaves = [a for n in names for a in jax.tree.leaves(call.arguments.get(n))
                      if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) and a.size]
            if emulated == "float32" or not leaves:
                return op(*args, **kwargs)
            exact = signature.bind(*args, **kwargs)
            exact.arguments["precision"] = "highest"
            infinite = beyond_bf16(*leaves)
            return jax.lax.cond(infinite, lambda: op(*exact.args, **exact.kwargs), lambda: op(*args, **kwargs))
        return run
    return decorate
