"""What every kernel pass shares as a JAX primitive: its definition, the vmap rule of the
FFI handlers' leading dims, and the sums a transpose needs.

A pass is one FFI call. As a ``Primitive`` it gets from its module, beside its definition,
a JVP rule (made of passes), a transpose rule where it is linear (the transposed passes, as
``lax.dot_general``'s are dot_generals) and the rules here; every mode of differentiation
then follows from that one definition.

Leading dims: the handlers take operands with extra leading dims that broadcast numpy-style
(``vmap_method="expand_dims"``: an unmapped operand arrives with size-1 dims and is read in
place; shared weights fold the items into the mini-batch). A pass's abstract evaluation
broadcasts them and its batching rule adds one, so vmap of any order is one call.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["define", "is_zero", "leading", "over_leading", "shapes_of", "unbroadcast", "undefined",
           "zero", "zero_like"]


def define(name: str, abstract: Callable, impl: Callable, core_ranks: Sequence[int] | Callable,
           multiple_results: bool = True, partitioned: bool = True) -> Primitive:
    """A primitive evaluated and lowered as ``impl(*operands, **params)`` (the FFI call, by
    ``jax.ffi.ffi_call``), shaped by ``abstract``, batched over leading dims in front of
    each operand's last ``core_ranks[i]`` dims (or ``core_ranks(*operands)``'s; operands
    past them are optional ones). ``partitioned``: ``impl`` calls ``partitioning.rows``."""
    p = Primitive(name)
    p.multiple_results = multiple_results
    p.def_impl(impl)
    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=multiple_results), platform="cpu")
    if partitioned:  # impl's call is a custom_partitioning one (ops/partitioning.py), lowered
        # with the devices known; jax's own cuDNN attention primitives register the same way
        dispatch.prim_requires_devices_during_lowering.add(p)
    batching.primitive_batchers[p] = partial(_batch, p, core_ranks if callable(core_ranks) else tuple(core_ranks))
    return p


def _batch(p, core_ranks, args, dims, **params):
    """The mapped dim in front of every operand, size 1 where unmapped, above leading dims
    made as many in every operand (numpy-style: size-1 dims where an operand has fewer)."""
    if callable(core_ranks):
        core_ranks = core_ranks(*args)
    ranks = [a.ndim - (d is not None) - r for a, d, r in zip(args, dims, core_ranks)]
    lead = max(ranks)
    moved = []
    for a, d, r in zip(args, dims, ranks):
        a = jnp.expand_dims(a, 0) if d is None else jnp.moveaxis(a, d, 0)
        moved.append(a.reshape(a.shape[:1] + (1,) * (lead - r) + a.shape[1:]))
    out = p.bind(*moved, **params)
    return out, ((0,) * len(out) if p.multiple_results else 0)


def shapes_of(fn: Callable, single: bool = False) -> Callable:
    """An abstract evaluation: ``fn``'s (the call's) result shapes, by ``jax.eval_shape``."""
    def abstract(*avals, **params):
        outs = jax.eval_shape(partial(fn, **params), *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
        outs = tuple(ShapedArray(o.shape, o.dtype) for o in jax.tree.leaves(outs))
        return outs[0] if single else outs
    return abstract


def over_leading(fn: Callable, core_ranks: Sequence[int], *args):
    """``fn`` of operands without leading dims, mapped over the leading dims ``args`` have
    (as many in each, size 1 where broadcast): for a primitive whose impl has no such dims
    of its own. ``jax.vmap`` over each in turn, so that the calls' own vmap rules apply."""
    if args[0].ndim == core_ranks[0]:
        return fn(*args)
    axes = tuple(None if a.shape[0] == 1 else 0 for a in args)
    inner = partial(over_leading, fn, core_ranks)
    args = [a[0] if ax is None else a for a, ax in zip(args, axes)]
    if all(ax is None for ax in axes):
        return jax.tree.map(lambda o: o[None], inner(*args))
    return jax.vmap(inner, in_axes=axes)(*args)


def leading(*operands_and_core_ranks) -> tuple[int, ...]:
    """The broadcast leading dims of ``(operand, core rank)`` pairs (vmap's, or () at top)."""
    return jnp.broadcast_shapes(*(tuple(a.shape[:len(a.shape) - r]) for a, r in operands_and_core_ranks))


def unbroadcast(x, shape):
    """``x`` summed over the dims that broadcasting added or expanded, back to ``shape``: a
    transpose's cotangent for an operand that was broadcast (a shared weight, a bias)."""
    extra = x.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        extra + i for i, s in enumerate(shape) if s == 1 and x.shape[extra + i] != 1)
    return jnp.sum(x, axis=axes).reshape(shape) if axes else x


def is_zero(t) -> bool:
    """A symbolic zero tangent or cotangent (``ad.Zero``): nothing to compute."""
    return type(t) is ad.Zero


def zero(a):
    """The symbolic zero tangent of a value ``a``."""
    return ad.Zero(jax.typeof(a).to_tangent_aval())


def zero_like(a):
    """The symbolic zero cotangent of a transpose's undefined operand ``a``."""
    return ad.Zero(a.aval.to_ct_aval())


def undefined(a) -> bool:
    """``a`` is the operand a transpose rule is linear in."""
    return ad.is_undefined_primal(a)


def weight_update_jvp(update_p: Primitive, primals, tangents, *, with_bias, **params):
    """The JVP of a weight update ``(dw, db) = update_p(x, dz)``, bilinear in (x, dz) (db, dz's
    sum, linear in dz alone): the update of each tangent against the other primal, two more
    calls of the same primitive. ``functools.partial(weight_update_jvp, update_p)`` is the rule."""
    (x, dz), (t_x, t_dz) = primals, tangents
    dw, db = update_p.bind(x, dz, with_bias=with_bias, **params)
    t_dw, t_db = [], zero(db)
    if not is_zero(t_x):
        t_dw.append(update_p.bind(t_x, dz, with_bias=False, **params)[0])
    if not is_zero(t_dz):
        w, b = update_p.bind(x, t_dz, with_bias=with_bias, **params)
        t_dw.append(w)
        t_db = b if with_bias else t_db
    return (dw, db), (sum(t_dw[1:], t_dw[0]) if t_dw else zero(dw), t_db)
