"""Sharding-aware custom calls: each kernel call runs per shard of a batch-sharded input.

Under plain ``jax.jit`` with inputs sharded along the batch (the rows of a mini-batch,
or the leading dims of ``jb.brgemm``), XLA's partitioner does not know what a custom
call computes, so it would all-gather the batch and run the whole call on every
device. :func:`rows` wraps one call's ffi_call function in
``jax.experimental.custom_partitioning`` with what each kernel is per row of the batch:

* ``"rows"`` operands and results are split by rows (dim 0), like the batch;
* ``None`` operands (weights, bias) are replicated; ``None`` results are computed whole
  on every device (they take no batch operand);
* ``"sum"`` results (the weight update ``x.T @ dz``, the bias gradient) are partial sums
  per shard, reduced over the batch's mesh axes with ``jax.lax.psum``: the only
  collective, on the weight-sized result.

On one device, inside ``shard_map`` (already per shard), and under ``jax.export`` of a
single-device function, custom_partitioning lowers the plain call: nothing changes there.
The calls are the impls of primitives (``ops/primitive.py``), whose batching rules handle
``jax.vmap`` before a call is made: custom_partitioning, which has no vmap rule, never sees
a batch.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

ROWS, SUM = "rows", "sum"


def _batch_axes(arg_shapes, operands):
    """The mesh axes the batch is split over: those of dim 0 of the first row operand."""
    for shape, kind in zip(arg_shapes, operands):
        if kind == ROWS and len(shape.shape) and shape.shape[0] > 0:
            sharding = shape.sharding
            spec = getattr(sharding, "spec", None)
            if spec and len(spec) and spec[0] is not None:
                return spec[0]
            return None
    return None


def _axes_tuple(axes):
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _spec(kind, ndim, axes):
    if kind == ROWS and ndim:
        return P(axes, *([None] * (ndim - 1)))
    return P(*([None] * ndim))


def rows(call: Callable, operands: Sequence, results: Sequence) -> Callable:
    """``call(*arrays)`` (an ffi_call of fixed static attributes, returning a tuple) made
    batch-partitionable: see the module docstring for ``operands`` and ``results``.

    Zero-size placeholders (e.g. the empty bias of a layer without one) are replicated
    whatever their kind.
    """
    operands, results = tuple(operands), tuple(results)

    def positional(*args):  # custom_partitioning binds arguments by the signature
        return call(*args)

    partitioned = custom_partitioning(positional)

    def partition(mesh, arg_shapes, result_shape):
        axes = _batch_axes(arg_shapes, operands)
        result_shapes = result_shape if isinstance(result_shape, (tuple, list)) else (
            result_shape,)

        def sharding(kind, shape):
            empty = 0 in shape.shape
            return NamedSharding(mesh, _spec(None if empty or axes is None else kind,
                                             len(shape.shape), axes))

        arg_shardings = tuple(sharding(k, s) for k, s in zip(operands, arg_shapes))
        out_shardings = tuple(sharding(k, s) for k, s in zip(results, result_shapes))

        def lower_fn(*args):
            out = call(*args)
            if axes is None:
                return out
            return tuple(jax.lax.psum(o, _axes_tuple(axes)) if k == SUM and o.size else o
                         for k, o in zip(results, out))

        return mesh, lower_fn, out_shardings, arg_shardings

    # Shardy's rule: the batch factor "n" on dim 0 of every row operand and result,
    # every other dim its own factor, replicated. "n" in no result (a weight update)
    # is a reduction over the batch.
    def sharding_rule(mesh, operand_types, result_types):
        # d0, d1, ...: a call may have more dims than the alphabet has letters
        names = (f"d{i}" for i in itertools.count())

        def factors(kind, ty):
            dims = list(ty.shape)
            if not dims:
                return ""
            first = "n" if kind == ROWS and dims[0] != 0 else next(names)
            return " ".join([first] + [next(names) for _ in dims[1:]])

        lhs = ", ".join(factors(k, t) for k, t in zip(operands, operand_types))
        rhs = ", ".join(factors(k, t) for k, t in zip(results, result_types))
        rule = f"{lhs} -> {rhs}"
        # in order of first appearance, as Shardy wants its special factors sorted
        tokens = rule.replace(",", " ").replace("->", " ").split()
        others = [f for f in dict.fromkeys(tokens) if f != "n"]
        options = {"need_replication_factors": tuple(others)}
        if "n" in lhs and "n" not in rhs:
            options["reduction_factors"] = ("n",)
        return rule, options

    partitioned.def_partition(partition=partition, sharding_rule=sharding_rule)
    return lambda *args: tuple(partitioned(*args))


def cached(make: Callable) -> Callable:
    """One partitioned call per static configuration (activation code, shapes, dtypes)."""
    return functools.lru_cache(maxsize=None)(make)
