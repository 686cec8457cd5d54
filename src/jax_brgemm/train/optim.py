"""Optimizers and learning-rate schedules, built from optax, keyed by MLPerf log names.

The approved optimizers (``approved=True``; MLPerf's allowed list) follow the update
rules written in docs/training.md (approved optimizers), and
tests/train/test_train_optim.py checks each against a direct implementation of its rule
over several steps:

- sgd, adam, adamw: optax's own ``sgd`` (after ``add_decayed_weights``), ``adam``,
  ``adamw`` (the rules of torch.optim.SGD, Adam and AdamW);
- lamb: optax's transforms composed so that the trust ratio applies to kernels only,
  as in MLPerf's BERT reference (``optax.lamb`` adapts biases too);
- lars: MLPerf's LARS, whose trust ratio eta*|w|/(|g| + wd*|w| + eps) is computed from
  the raw gradient (``optax.lars`` uses |g + wd*w|); ``lars_direction`` below,
  composed with optax's learning-rate scaling and momentum.

Others (``approved=False``) are for the open division only. Weight decay and trust
ratios apply to kernels only: biases and normalization parameters (the 1-D leaves)
are excluded, the convention of MLPerf's LARS and LAMB references.
"""

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

# Schedule hyperparameters shared by every optimizer (MLPerf log key -> meaning):
#   opt_base_learning_rate             peak learning rate, reached after warmup
#   opt_end_learning_rate              learning rate at the end of the decay (and after)
#   opt_learning_rate_warmup_epochs    linear warmup from 0 (may be fractional)
#   opt_learning_rate_decay_schedule   "cosine" | "polynomial"
#   opt_learning_rate_decay_epochs     epoch at which the decay ends (warmup included)
# and the keys of one decay schedule only, with their defaults (a key is logged and
# validated only with the schedule that uses it):
#   opt_learning_rate_decay_poly_power power of the polynomial decay
SCHEDULE_OPTIONS = {"cosine": {}, "polynomial": {"opt_learning_rate_decay_poly_power": 2.0}}
DECAY_SCHEDULES = tuple(SCHEDULE_OPTIONS)


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


def lars_direction(weight_decay, trust_coefficient, eps, mask) -> optax.GradientTransformation:
    """MLPerf LARS's scaled gradient: for the leaves ``mask`` selects,
    ``eta*|w| / (|g| + wd*|w| + eps) * (g + wd*w)`` (ratio 1 where |w| or |g| is 0);
    other leaves pass ``g`` unchanged."""

    def update(updates, state, params):
        def direction(g, w, adapt):
            if not adapt:
                return g
            w_norm, g_norm = jnp.linalg.norm(w), jnp.linalg.norm(g)
            ratio = jnp.where((w_norm > 0) & (g_norm > 0),
                              trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps),
                              1.0)
            return ratio * (g + weight_decay * w)

        return jax.tree.map(direction, updates, params, mask(params)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _lars(lr, hp):
    return optax.chain(
        lars_direction(hp["lars_opt_weight_decay"], hp["lars_opt_trust_coefficient"],
                       hp["lars_epsilon"], kernel_mask),
        optax.scale_by_learning_rate(lr),
        optax.trace(decay=hp["lars_opt_momentum"]))


def _adam(lr, hp):
    return optax.adam(lr, b1=hp["opt_adam_beta_1"], b2=hp["opt_adam_beta_2"],
                      eps=hp["opt_adam_epsilon"])


def _adamw(lr, hp):
    return optax.adamw(lr, b1=hp["opt_adamw_beta_1"], b2=hp["opt_adamw_beta_2"],
                       eps=hp["opt_adamw_epsilon"], weight_decay=hp["opt_adamw_weight_decay"],
                       mask=kernel_mask)


def _lamb(lr, hp):
    return optax.chain(
        optax.scale_by_adam(b1=hp["opt_lamb_beta_1"], b2=hp["opt_lamb_beta_2"],
                            eps=hp["opt_lamb_epsilon"]),
        optax.add_decayed_weights(hp["opt_lamb_weight_decay_rate"], kernel_mask),
        optax.masked(optax.scale_by_trust_ratio(), kernel_mask),
        optax.scale_by_learning_rate(lr))


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
