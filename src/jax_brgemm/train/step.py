"""The train and eval steps every benchmark uses, and the state they carry.

Data parallelism slots in through ``axis_name``: run the steps under ``shard_map``
(or ``jax.vmap``) over a named axis, each instance on its shard of the global batch,
and the loss, the gradients and the model state (e.g. BatchNorm statistics) are
averaged over the axis in one all-reduce, so every instance applies the same update. Without ``axis_name`` the steps are plain single-device steps.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from flax.training import train_state


class TrainState(train_state.TrainState):
    """Parameters and optimizer state (flax's TrainState) plus the model state: the
    variable collections besides ``params`` (e.g. ``batch_stats``) that the model
    updates while training and reads in evaluation; ``{}`` for a stateless model."""

    model_state: Any


def create_state(bench, model, tx, rng, example_inputs) -> TrainState:
    """Initializes the model on ``example_inputs`` (preprocessed, batch of one)."""
    variables = dict(model.init(rng, example_inputs, **_apply_kwargs(bench, train=False)))
    params = variables.pop("params")
    if set(variables) != set(bench.model_state):
        raise ValueError(f"benchmark {bench.name} declares model state {list(bench.model_state)} "
                         f"but its model has the variable collections {sorted(variables)}")
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx, model_state=variables)


def _apply_kwargs(bench, train: bool) -> dict:
    """A model with model state is told whether it trains (flax's ``train`` convention)."""
    return {"train": train} if bench.model_state else {}


def all_reduce(tree, axis_name: str):
    """psum of every leaf of ``tree`` over the axis in one collective: the leaves travel as
    one flat fp32 vector. (Each collective has a fixed cost, ~3.5 ms with gloo between two
    processes on one machine: one per gradient leaf made ResNet's step all-reduce 118 ms
    for 0.3 MiB.)"""
    flat, unravel = ravel_pytree(tree)
    return unravel(jax.lax.psum(flat.astype(jnp.float32), axis_name).astype(flat.dtype))


def train_step(state: TrainState, batch, *, bench, axis_name: Optional[str] = None):
    """One optimizer step on a batch (or on this instance's shard of it).

    The loss is the mean over the real examples (weight 1) of the global batch. Over an
    axis, every instance differentiates its shard's weighted sum; the sums, the gradients
    of the sums, the real-example counts and the model states are summed over the axis in
    one all-reduce, then divided by the global count (the model state by the axis size).
    Padding rows do reach BatchNorm's batch statistics, which the rules allow.
    """

    def loss_fn(params):
        variables = {"params": params, **state.model_state}
        inputs = bench.pipeline.preprocess(batch.inputs)
        if bench.model_state:
            outputs, model_state = state.apply_fn(variables, inputs, train=True,
                                                  mutable=list(bench.model_state))
        else:
            outputs, model_state = state.apply_fn(variables, inputs), state.model_state
        total = jnp.sum(bench.loss(outputs, batch.labels) * batch.weight)
        return (total if axis_name else total / jnp.sum(batch.weight)), model_state

    (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    if axis_name is not None:
        size = jax.lax.psum(1, axis_name)  # a constant: the axis size
        loss, grads, count, model_state = all_reduce(
            (loss, grads, jnp.sum(batch.weight), model_state), axis_name)
        loss, grads = jax.tree.map(lambda x: x / count, (loss, grads))
        model_state = jax.tree.map(lambda x: x / size, model_state)
    return state.apply_gradients(grads=grads, model_state=model_state), loss


def eval_step(state: TrainState, batch, *, bench, axis_name: Optional[str] = None):
    """Sum of the metric's per-example scores over the real examples of the batch
    (summed over the axis too, when given)."""
    variables = {"params": state.params, **state.model_state}
    outputs = state.apply_fn(variables, bench.pipeline.preprocess(batch.inputs),
                             **_apply_kwargs(bench, train=False))
    total = jnp.sum(bench.metric.per_example(outputs, batch.labels) * batch.weight)
    return total if axis_name is None else jax.lax.psum(total, axis_name)
