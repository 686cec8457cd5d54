"""Optimizers and learning-rate schedules, all from optax, keyed by MLPerf log names.

Every optimizer here is optax's own implementation of an optimizer on MLPerf's
allowed list (``approved=True``) except those marked otherwise, which only the
open division may use. Weight decay (and LARS/LAMB trust-ratio adaptation)
applies to kernels only: biases and normalization parameters (the 1-D leaves)
are excluded, the usual convention and the one MLPerf's LARS uses.
"""

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import optax

# Schedule hyperparameters shared by every optimizer (MLPerf log key -> meaning):
#   opt_base_learning_rate             peak learning rate, reached after warmup
#   opt_end_learning_rate              learning rate at the end of the decay (and after)
#   opt_learning_rate_warmup_epochs    linear warmup from 0 (may be fractional)
#   opt_learning_rate_decay_schedule   "cosine" | "polynomial"
#   opt_learning_rate_decay_epochs     epoch at which the decay ends (warmup included)
#   opt_learning_rate_decay_poly_power power of the polynomial decay
SCHEDULE_KEYS = (
    "opt_base_learning_rate",
    "opt_end_learning_rate",
    "opt_learning_rate_warmup_epochs",
    "opt_learning_rate_decay_schedule",
    "opt_learning_rate_decay_epochs",
    "opt_learning_rate_decay_poly_power",
)
DECAY_SCHEDULES = ("cosine", "polynomial")


def schedule(hp: Mapping[str, Any], steps_per_epoch: int) -> optax.Schedule:
    """Linear warmup to the base rate, then cosine or polynomial decay to the end rate."""
    base, end = hp["opt_base_learning_rate"], hp["opt_end_learning_rate"]
    warmup = round(hp["opt_learning_rate_warmup_epochs"] * steps_per_epoch)
    total = max(round(hp["opt_learning_rate_decay_epochs"] * steps_per_epoch), warmup + 1)
    kind = hp["opt_learning_rate_decay_schedule"]
    if kind == "cosine":
        decay = optax.cosine_decay_schedule(base, total - warmup, alpha=end / base if base else 0.0)
    elif kind == "polynomial":
        decay = optax.polynomial_schedule(base, end, hp["opt_learning_rate_decay_poly_power"],
                                          total - warmup)
    else:
        raise ValueError(f"unknown decay schedule {kind!r}; expected one of {DECAY_SCHEDULES}")
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, base, warmup), decay], [warmup])


def kernel_mask(params):
    """True for the leaves that get weight decay / trust-ratio adaptation."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def _sgd(lr, hp):
    return optax.chain(
        optax.add_decayed_weights(hp["opt_weight_decay"], kernel_mask),
        optax.sgd(lr, momentum=hp["sgd_opt_momentum"], nesterov=hp["sgd_opt_nesterov"]))


def _lars(lr, hp):
    return optax.lars(lr, weight_decay=hp["lars_opt_weight_decay"], weight_decay_mask=kernel_mask,
                      trust_coefficient=hp["lars_opt_trust_coefficient"], eps=hp["lars_epsilon"],
                      trust_ratio_mask=kernel_mask, momentum=hp["lars_opt_momentum"])


def _adam(lr, hp):
    return optax.adam(lr, b1=hp["opt_adam_beta_1"], b2=hp["opt_adam_beta_2"],
                      eps=hp["opt_adam_epsilon"])


def _adamw(lr, hp):
    return optax.adamw(lr, b1=hp["opt_adamw_beta_1"], b2=hp["opt_adamw_beta_2"],
                       eps=hp["opt_adamw_epsilon"], weight_decay=hp["opt_adamw_weight_decay"],
                       mask=kernel_mask)


def _lamb(lr, hp):
    return optax.lamb(lr, b1=hp["opt_lamb_beta_1"], b2=hp["opt_lamb_beta_2"],
                      eps=hp["opt_lamb_epsilon"], weight_decay=hp["opt_lamb_weight_decay_rate"],
                      mask=kernel_mask)


def _rmsprop(lr, hp):
    return optax.rmsprop(lr, decay=hp["opt_rmsprop_decay"], eps=hp["opt_rmsprop_epsilon"],
                         momentum=hp["opt_rmsprop_momentum"] or None)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax optimizer with its hyperparameters (MLPerf log key -> default)."""

    name: str
    approved: bool
    defaults: Mapping[str, Any]
    build: Callable[[optax.Schedule, Mapping[str, Any]], optax.GradientTransformation]


OPTIMIZERS = {o.name: o for o in [
    Optimizer("sgd", True, {"sgd_opt_momentum": 0.9, "sgd_opt_nesterov": False,
                            "opt_weight_decay": 0.0}, _sgd),
    Optimizer("lars", True, {"lars_opt_momentum": 0.9, "lars_opt_weight_decay": 0.0,
                             "lars_opt_trust_coefficient": 0.001, "lars_epsilon": 0.0}, _lars),
    Optimizer("adam", True, {"opt_adam_beta_1": 0.9, "opt_adam_beta_2": 0.999,
                             "opt_adam_epsilon": 1e-8}, _adam),
    Optimizer("adamw", True, {"opt_adamw_beta_1": 0.9, "opt_adamw_beta_2": 0.999,
                              "opt_adamw_epsilon": 1e-8, "opt_adamw_weight_decay": 1e-4}, _adamw),
    Optimizer("lamb", True, {"opt_lamb_beta_1": 0.9, "opt_lamb_beta_2": 0.999,
                             "opt_lamb_epsilon": 1e-6, "opt_lamb_weight_decay_rate": 0.0}, _lamb),
    # Not on MLPerf's allowed list: open division only.
    Optimizer("rmsprop", False, {"opt_rmsprop_decay": 0.9, "opt_rmsprop_epsilon": 1e-8,
                                 "opt_rmsprop_momentum": 0.0}, _rmsprop),
]}


def make(hp: Mapping[str, Any], steps_per_epoch: int) -> optax.GradientTransformation:
    """The optimizer described by the (validated) hyperparameters ``hp``."""
    return OPTIMIZERS[hp["opt_name"]].build(schedule(hp, steps_per_epoch), hp)


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    return math.ceil(num_examples / batch_size)
