"""The train step with the optimizer fused into the dense layers' weight updates.

A model's weight gradients are only read by the optimizer. With SGD (optax's
``add_decayed_weights`` + ``sgd``, ``optim._sgd``) each element of a gradient is used once,
right away, so the weight update can apply the step to the parameters and their momenta
while each block of the gradient is still in cache, and never write the gradient out:
``jax_brgemm.ops.dense.sgd_update``. On the main job's MLP (fp32, batch 256) optax's step
otherwise reads and writes the three 1024-wide layers' weights, momenta and gradients
from memory after the backward pass.

The step differentiates the loss with respect to every dense layer's *output* instead of
its parameters (a zero "tap" added to each output, so ``jax.grad`` yields the true
``dL/dy``; the parameters are constants, so no weight gradient is formed), keeps each layer's
input and output (returned as auxiliary values), and then runs one fused update per layer
with ``dz = dy * act'(y)``. The result is optax's update (``tests/train/test_train_fused.py``
compares parameters and optimizer state after several steps), in optax's own state
structure: checkpoints, evaluation and the logs do not change.

It applies when every parameter belongs to a ``jax_brgemm.nn.Dense`` called once per step
with an activation whose derivative is a function of its output (none, relu, sigmoid,
tanh), flax's dtype promotion and no custom ``dot_general``, with float32 parameters, no model state, the ``sgd`` optimizer and one process
(data parallelism must all-reduce the gradients first). ``plan`` returns None otherwise,
and the harness takes the generic ``step.train_step``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from flax.linen.dtypes import promote_dtype as flax_promote_dtype

import jax_brgemm as jb
from jax_brgemm.ops import dense as dense_ops

from . import optim

# Activations whose derivative the layer's output gives.
_FROM_OUTPUT = (None, "relu", "sigmoid", "tanh")


@dataclasses.dataclass(frozen=True)
class Site:
    """One dense layer call: its module path, computation dtype, activation, bias."""

    path: tuple
    dtype: Any
    activation: Optional[str]
    bias: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    sites: tuple  # of Site
    schedule: Callable  # count -> learning rate
    momentum: float
    nesterov: bool
    weight_decay: float


def _dense_calls(apply_fn, params, inputs, taps=None, seen=None):
    """Applies the model; each jb.nn.Dense call is recorded in ``seen`` (path -> list of
    (module, x, y)) and, when ``taps`` holds its path, returns its output plus the tap."""

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or type(module) is not jb.nn.Dense:
            return next_fun(*args, **kwargs)
        y = next_fun(*args, **kwargs)
        if seen is not None:
            seen.setdefault(module.path, []).append((module, args[0], y))
        return y + taps[module.path] if taps is not None and module.path in taps else y

    with nn.intercept_methods(intercept):
        return apply_fn({"params": params}, inputs)


def plan(bench, state, example_inputs, hp, steps_per_epoch, *, processes: int = 1) -> Optional[Plan]:
    """The fused step's plan for this model and optimizer, or None where it does not apply
    (see the module docstring). ``example_inputs``: a preprocessed batch of one."""
    if hp["opt_name"] != "sgd" or processes != 1 or bench.model_state:
        return None
    sites, seen = [], {}
    jax.eval_shape(lambda p, x: _dense_calls(state.apply_fn, p, x, seen=seen), state.params,
                   example_inputs)
    covered = set()
    for path, calls in seen.items():
        module, _, y = calls[0]
        # The layer must compute act(promote(x) @ kernel + bias) on the kernels: flax's own
        # dtype promotion, no custom dot_general.
        if (len(calls) != 1 or module.activation not in _FROM_OUTPUT
                or y.dtype not in (jnp.float32, jnp.bfloat16)
                or module.promote_dtype is not flax_promote_dtype
                or module.dot_general is not None or module.dot_general_cls is not None):
            return None
        sites.append(Site(path, y.dtype, module.activation, module.use_bias))
        covered |= {path + ("kernel",)} | ({path + ("bias",)} if module.use_bias else set())
    flat = traverse_util.flatten_dict(dict(state.params))
    if set(flat) != covered or any(a.dtype != jnp.float32 for a in flat.values()):
        return None
    return Plan(tuple(sites), optim.schedule(hp, steps_per_epoch), hp["sgd_opt_momentum"],
                hp["sgd_opt_nesterov"], hp["opt_weight_decay"])


def train_step(state, batch, *, bench, plan: Plan):
    """``step.train_step``'s update (same loss, same result within rounding), with SGD
    fused into the weight updates."""
    inputs = bench.pipeline.preprocess(batch.inputs)
    outputs = {}  # each layer's output shape on this batch (traced, not run)
    jax.eval_shape(lambda p, x: _dense_calls(state.apply_fn, p, x, seen=outputs), state.params, inputs)
    taps = {s.path: jnp.zeros(outputs[s.path][0][2].shape, s.dtype) for s in plan.sites}

    def loss_fn(taps):
        seen = {}
        outputs = _dense_calls(state.apply_fn, state.params, inputs, taps, seen)
        loss = jnp.sum(bench.loss(outputs, batch.labels) * batch.weight) / jnp.sum(batch.weight)
        return loss, {path: calls[0][1:] for path, calls in seen.items()}

    (loss, xy), dys = jax.value_and_grad(loss_fn, has_aux=True)(taps)
    count = optax.tree_utils.tree_get(state.opt_state, "count")
    lr = plan.schedule(count)
    params = dict(state.params)
    trace = dict(optax.tree_utils.tree_get(state.opt_state, "trace"))
    for i, s in enumerate(plan.sites):
        x, y = xy[s.path]
        c = x.shape[-1]
        x = x.reshape(-1, c).astype(s.dtype)
        dz = dense_ops.act_grad(dys[s.path], y, s.activation).reshape(x.shape[0], -1)
        p, m = _get(params, s.path), _get(trace, s.path)
        with jax.named_scope("/".join(s.path)):  # profiles name the layer
            k, mk, b, mb = dense_ops.sgd_update(
                x, dz, p["kernel"], m["kernel"], p.get("bias"), m.get("bias"), lr,
                momentum=plan.momentum, nesterov=plan.nesterov, weight_decay=plan.weight_decay,
                # the previous layer's output gradient: in a chain of layers, this one's
                # backward pass (the other reader of its kernel) made it, so XLA need not
                # copy the kernel before the update rewrites it
                after=dys[plan.sites[i - 1].path] if i else None)
        _set(params, s.path, {"kernel": k, **({"bias": b} if s.bias else {})})
        _set(trace, s.path, {"kernel": mk, **({"bias": mb} if s.bias else {})})
    opt_state = optax.tree_utils.tree_set(state.opt_state, trace=trace,
                                          count=optax.safe_increment(count))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), loss


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    """Sets ``tree[path]`` to ``value``, copying the dicts along the path (the input stays)."""
    for key in path[:-1]:
        tree[key] = dict(tree[key])
        tree = tree[key]
    tree[path[-1]] = value
