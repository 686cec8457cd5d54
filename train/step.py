"""The train and eval steps every benchmark uses, and the state they carry.

Data parallelism slots in through ``axis_name``: run the steps under ``shard_map``
(or ``jax.vmap``) over a named axis, each instance on its shard of the global batch,
and the loss, the gradients and the model state (e.g. BatchNorm statistics) are
averaged over the axis with ``jax.lax.pmean``, so every instance applies the same
update. Without ``axis_name`` the steps are plain single-device steps.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
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


def _mean(x, axis_name: Optional[str]):
    return x if axis_name is None else jax.lax.pmean(x, axis_name)


def train_step(state: TrainState, batch, *, bench, axis_name: Optional[str] = None):
    """One optimizer step on a batch (or on this instance's shard of it).

    The loss is the mean over the real examples (weight 1) of the global batch:
    each shard's weighted sum divided by the mean real-example count per shard, then
    averaged over the axis. Padding rows do reach BatchNorm's batch statistics, which
    the rules allow.
    """

    def loss_fn(params):
        variables = {"params": params, **state.model_state}
        inputs = bench.pipeline.preprocess(batch.inputs)
        if bench.model_state:
            outputs, model_state = state.apply_fn(variables, inputs, train=True,
                                                  mutable=list(bench.model_state))
        else:
            outputs, model_state = state.apply_fn(variables, inputs), state.model_state
        losses = bench.loss(outputs, batch.labels)
        count = _mean(jnp.sum(batch.weight), axis_name)
        return jnp.sum(losses * batch.weight) / count, model_state

    (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    loss, grads, model_state = _mean((loss, grads, model_state), axis_name)
    return state.apply_gradients(grads=grads, model_state=model_state), loss


def eval_step(state: TrainState, batch, *, bench, axis_name: Optional[str] = None):
    """Sum of the metric's per-example scores over the real examples of the batch
    (summed over the axis too, when given)."""
    variables = {"params": state.params, **state.model_state}
    outputs = state.apply_fn(variables, bench.pipeline.preprocess(batch.inputs),
                             **_apply_kwargs(bench, train=False))
    total = jnp.sum(bench.metric.per_example(outputs, batch.labels) * batch.weight)
    return total if axis_name is None else jax.lax.psum(total, axis_name)
