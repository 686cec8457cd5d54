"""The train step with the optimizer fused into the dense layers' weight updates.

A model's weight gradients are only read by the optimizer. With SGD (optax's
``add_decayed_weights`` + ``sgd``, ``optim._sgd``), AdamW and Adam each element of a gradient
is used once, right away, so the weight update can apply the step to the parameters and
their optimizer state while each block of the gradient is still in cache, and never write
the gradient out. ``jax_brgemm.optim.train_step`` builds that step for any loss; here the
harness marks its own optax transformation (``optim.make``) with the rule it computes, from
the hyperparameters, and runs the benchmark's loss through it.

The result is optax's update (``tests/train/test_train_fused.py`` compares parameters and
optimizer state after several steps), in optax's own state structure: checkpoints,
evaluation and the logs do not change.

It applies to the dense layers on the kernels (``jax_brgemm.nn.Dense``, ``jb.dense``) called
once per step with an activation whose derivative is a function of its output (none, relu,
sigmoid, tanh), with float32 parameters, no model state, the ``sgd``, ``adam`` or ``adamw``
optimizer and one process (data parallelism must all-reduce the gradients first); the
model's other parameters take optax's own step in the same jitted step. ``plan`` returns
None where no layer qualifies, and the harness takes the generic ``step.train_step``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jax_brgemm import optim as jbo

from . import optim

_RULES = ("sgd", "adam", "adamw")


@dataclasses.dataclass(frozen=True)
class Plan:
    rule: jbo.Rule
    sites: int  # how many dense layers take the fused update


def rule(hp, steps_per_epoch) -> Optional[jbo.Rule]:
    """The rule the harness's optimizer (``optim.make(hp, ...)``) computes, or None."""
    lr, name = optim.schedule(hp, steps_per_epoch), hp["opt_name"]
    if name == "sgd":
        return jbo.Rule("sgd", lr, hp["opt_weight_decay"], optim.kernel_mask,
                        momentum=hp["sgd_opt_momentum"], nesterov=hp["sgd_opt_nesterov"])
    if name == "adamw":
        return jbo.Rule("adamw", lr, hp["opt_adamw_weight_decay"], optim.kernel_mask,
                        b1=hp["opt_adamw_beta_1"], b2=hp["opt_adamw_beta_2"], eps=hp["opt_adamw_epsilon"])
    if name == "adam":
        return jbo.Rule("adamw", lr, b1=hp["opt_adam_beta_1"], b2=hp["opt_adam_beta_2"],
                        eps=hp["opt_adam_epsilon"])
    return None


def _loss_fn(state, batch, bench):
    inputs = bench.pipeline.preprocess(batch.inputs)

    def loss_fn(params):
        outputs = state.apply_fn({"params": params}, inputs)
        return jnp.sum(bench.loss(outputs, batch.labels) * batch.weight) / jnp.sum(batch.weight)

    return loss_fn


def plan(bench, state, example_inputs, hp, steps_per_epoch, *, processes: int = 1) -> Optional[Plan]:
    """The fused step's plan for this model and optimizer, or None where it does not apply
    (see the module docstring). ``example_inputs``: a preprocessed batch of one."""
    if hp["opt_name"] not in _RULES or processes != 1 or bench.model_state:
        return None
    def outputs(params):  # what the dense calls are: any scalar of the outputs will do
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(
            state.apply_fn({"params": params}, example_inputs)))

    sites = jbo.fused_layers(outputs, state.params)
    return Plan(rule(hp, steps_per_epoch), sites) if sites else None


def train_step(state, batch, *, bench, plan: Plan):
    """``step.train_step``'s update (same loss, same result within rounding), with the
    optimizer fused into the dense layers' weight updates."""
    tx = jbo.fusable(state.tx, plan.rule)
    params, opt_state, loss = jbo.train_step(_loss_fn(state, batch, bench), tx)(state.params, state.opt_state)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), loss
