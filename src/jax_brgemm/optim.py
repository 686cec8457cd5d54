"""Training steps with the optimizer fused into the dense layers' weight updates.

In a training step a dense layer's weight gradient is read only by the optimizer. For
optax's SGD with momentum (Nesterov or not) and AdamW/Adam the weight update can apply the
step to the parameters and their optimizer state while each block of the gradient is
still in cache, and never write the gradient out (``ops.dense.sgd_update``,
``ops.dense.adamw_update``)::

    import jax_brgemm.optim as jbo

    tx = jbo.adamw(1e-3, weight_decay=1e-4)   # optax.adamw's own transformation
    opt_state = tx.init(params)                # optax's own state
    step = jax.jit(jbo.train_step(loss_fn, tx), donate_argnums=(0, 1))
    params, opt_state, loss = step(params, opt_state, batch)

``sgd``, ``adam`` and ``adamw`` take optax's arguments and return optax's transformation
(``tx.init`` / ``tx.update`` are optax's, the state is optax's: checkpoints do not change),
marked with the rule they apply. ``train_step(loss_fn, tx)`` computes what
``value_and_grad`` + ``tx.update`` + ``optax.apply_updates`` compute (equal within fp32
rounding; ``tests/train/test_optim.py``), for any ``tx``: the dense calls it can fuse are
those on the kernels (``jb.dense``, ``jb.nn.Dense``, ``jb.nnx.Linear``, layers run by
``accelerate()``) whose float32 kernel (and bias) is a parameter leaf used by that call
alone, with an activation whose derivative is a function of its output (none, relu,
sigmoid, tanh). Every other parameter takes optax's own update in the same step; an
unmarked ``tx`` takes the generic step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jex_core

from jax_brgemm.ops import dense as dense_ops
from jax_brgemm.ops import fc_passes

__all__ = ["Rule", "adam", "adamw", "fusable", "fused_layers", "sgd", "train_step"]

# Activation codes whose derivative the layer's output gives.
_FROM_OUTPUT = tuple(fc_passes.ACTIVATION_CODES[a] for a in ("none", "relu", "sigmoid", "tanh"))


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a marked transformation computes, per parameter leaf: ``kind`` "sgd"
    (``add_decayed_weights`` + ``sgd`` with momentum) or "adamw" (``adamw``; ``adam`` is
    weight_decay 0); ``mask`` as optax's (None: every leaf decays)."""

    kind: str
    learning_rate: Any  # a float or an optax schedule of the step count
    weight_decay: float = 0.0
    mask: Any = None
    momentum: float = 0.0
    nesterov: bool = False
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0


class _Marked(optax.GradientTransformationExtraArgs):
    """optax's transformation, unchanged, with the rule it applies (``_jb_rule``)."""


def fusable(tx: optax.GradientTransformation, rule: Rule) -> optax.GradientTransformation:
    """``tx`` marked as computing ``rule`` (the caller vouches for it)."""
    if rule.kind not in ("sgd", "adamw"):
        raise ValueError(f"fusable: rule.kind must be 'sgd' or 'adamw', got {rule.kind!r}")
    marked = _Marked(tx.init, tx.update)
    marked._jb_rule = rule
    return marked


def sgd(learning_rate, momentum=None, nesterov=False, *, weight_decay=0.0, mask=None):
    """``optax.sgd(learning_rate, momentum, nesterov)``, after
    ``optax.add_decayed_weights(weight_decay, mask)`` when ``weight_decay`` is not 0.
    Fused with momentum only (plain SGD keeps the generic step)."""
    tx = optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)
    if weight_decay:
        tx = optax.chain(optax.add_decayed_weights(weight_decay, mask), tx)
    if not momentum:
        return tx
    return fusable(tx, Rule("sgd", learning_rate, weight_decay, mask, momentum=momentum,
                            nesterov=bool(nesterov)))


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=1e-4, mask=None):
    """``optax.adamw`` with these arguments (fp32 moments, no Nesterov)."""
    tx = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                     weight_decay=weight_decay, mask=mask)
    return fusable(tx, Rule("adamw", learning_rate, weight_decay, mask, b1=b1, b2=b2, eps=eps,
                            eps_root=eps_root))


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0):
    """``optax.adam`` with these arguments (fp32 moments, no Nesterov)."""
    tx = optax.adam(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return fusable(tx, Rule("adamw", learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root))


@dataclasses.dataclass(frozen=True)
class _Site:
    kernel: int  # leaf index of the kernel
    bias: Optional[int]  # of the bias, or None
    act: int
    y: jax.ShapeDtypeStruct  # the call's 2-D output


def _sites(loss_fn, leaves, treedef, args, kwargs):
    """The dense calls whose step can be fused, in call order: kernels (and biases) that are
    float32 parameter leaves used by one dense call on the kernels and by nothing else."""
    calls = []

    def traced(leaves, args, kwargs):
        ids = {id(leaf): i for i, leaf in enumerate(leaves)}

        def record(x, kernel, bias, act, y):
            calls.append((ids.get(id(kernel)), None if bias is None else ids.get(id(bias), -1), act,
                          jax.ShapeDtypeStruct(y.shape, y.dtype)))
            return y

        with dense_ops.observe(record):
            return loss_fn(treedef.unflatten(leaves), *args, **kwargs)

    jaxpr = jax.make_jaxpr(traced)(leaves, args, kwargs).jaxpr
    uses = {}  # leaf index -> the equations reading it
    invars = {v: i for i, v in enumerate(jaxpr.invars[:len(leaves)])}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jex_core.Var) and v in invars:
                uses.setdefault(invars[v], set()).add(id(eqn))
    outs = {invars[v] for v in jaxpr.outvars if isinstance(v, jex_core.Var) and v in invars}
    kernels = [c[0] for c in calls]
    sites = []
    for k, b, act, y in calls:
        once = lambda i: (i is not None and i >= 0 and i not in outs and len(uses.get(i, ())) == 1
                          and leaves[i].dtype == jnp.float32)
        if (act in _FROM_OUTPUT and once(k) and kernels.count(k) == 1
                and (b is None or (once(b) and uses[b] == uses[k])) and leaves[k].ndim == 2):
            sites.append(_Site(k, b, act, y))
    return tuple(sites)


def fused_layers(loss_fn: Callable, params, *args, **kwargs) -> int:
    """How many of ``loss_fn(params, *args, **kwargs)``'s dense calls ``train_step`` fuses
    with a marked optimizer (traced, not run)."""
    leaves, treedef = jax.tree.flatten(params)
    return len(_sites(loss_fn, leaves, treedef, args, kwargs))


def train_step(loss_fn: Callable, tx: optax.GradientTransformation, *, has_aux: bool = False):
    """``step(params, opt_state, *args, **kwargs) -> (params, opt_state, loss)`` (``loss`` is
    ``(loss, aux)`` with ``has_aux``): one step of ``tx`` on ``loss_fn(params, *args,
    **kwargs)``'s gradient, with the step fused into the dense layers' weight updates where
    ``tx`` is marked (``sgd``, ``adam``, ``adamw``, ``fusable``) and the layers allow it
    (module docstring). Jit it, donating params and opt_state, for the updates in place."""
    if not callable(loss_fn):
        raise TypeError(f"train_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"train_step: tx must be an optax GradientTransformation, got {type(tx).__name__}")
    rule = getattr(tx, "_jb_rule", None)

    def generic(params, opt_state, *args, **kwargs):
        out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, *args, **kwargs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    def step(params, opt_state, *args, **kwargs):
        leaves, treedef = jax.tree.flatten(params)
        sites = _sites(loss_fn, leaves, treedef, args, kwargs) if rule is not None else ()
        if not sites:
            return generic(params, opt_state, *args, **kwargs)
        return _fused_step(loss_fn, tx, rule, has_aux, sites, leaves, treedef, opt_state, args, kwargs)

    return step


def _fused_step(loss_fn, tx, rule, has_aux, sites, leaves, treedef, opt_state, args, kwargs):
    fused = {s.kernel: s for s in sites}
    skip = set(fused) | {s.bias for s in sites if s.bias is not None}
    rest = [i for i in range(len(leaves)) if i not in skip]

    def run(taps, rest_leaves, saved):
        full = list(leaves)
        for i, leaf in zip(rest, rest_leaves):
            full[i] = leaf
        ids = {id(leaves[i]): i for i in fused}  # the fused leaves are constants here

        def tap(x, kernel, bias, act, y):
            i = ids.get(id(kernel))
            if i is None:
                return y
            saved[i] = (x, y)
            return y + taps[i]

        with dense_ops.observe(tap):
            out = loss_fn(treedef.unflatten(full), *args, **kwargs)
        return out if has_aux else (out, None)

    taps = {s.kernel: jnp.zeros(s.y.shape, s.y.dtype) for s in sites}

    def loss_taps(taps, rest_leaves):
        saved = {}
        loss, aux = run(taps, rest_leaves, saved)
        return loss, (aux, saved)

    (loss, (aux, saved)), (dys, g_rest) = jax.value_and_grad(
        loss_taps, argnums=(0, 1), has_aux=True)(taps, [leaves[i] for i in rest])

    # optax's own step for the other leaves (what it computes for the fused ones, from zero
    # gradients, is replaced below and never runs: XLA drops it)
    grads = [jnp.zeros_like(leaf) for leaf in leaves]
    for i, g in zip(rest, g_rest):
        grads[i] = g
    params = treedef.unflatten(leaves)
    updates, new_state = tx.update(treedef.unflatten(grads), opt_state, params)
    new_leaves = treedef.flatten_up_to(optax.apply_updates(params, updates))

    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    count = counts[0][1] if counts else jnp.zeros((), jnp.int32)
    lr = rule.learning_rate(count) if callable(rule.learning_rate) else rule.learning_rate
    mask = rule.mask(params) if callable(rule.mask) else rule.mask
    decays = treedef.flatten_up_to(mask) if mask is not None else [True] * len(leaves)
    wd = lambda i: rule.weight_decay if i is not None and decays[i] else 0.0
    names = ("trace",) if rule.kind == "sgd" else ("mu", "nu")
    old = [treedef.flatten_up_to(optax.tree_utils.tree_get(opt_state, n)) for n in names]
    new = [treedef.flatten_up_to(optax.tree_utils.tree_get(new_state, n)) for n in names]

    previous = None
    for s in sites:
        x, y = saved[s.kernel]
        dy = dys[s.kernel]
        dz = dy if s.act == fc_passes.NONE else fc_passes.activation_grad(dy, y, s.act)
        b = None if s.bias is None else leaves[s.bias]
        state = [(o[s.kernel], None if s.bias is None else o[s.bias]) for o in old]
        if rule.kind == "sgd":
            k, mk, bb, mb = dense_ops.sgd_update(
                x, dz, leaves[s.kernel], state[0][0], b, state[0][1], lr, momentum=rule.momentum,
                nesterov=rule.nesterov, weight_decay=wd(s.kernel), bias_weight_decay=wd(s.bias),
                after=previous)
            outs = [(mk, mb)]
        else:
            k, mu, nu, bb, bmu, bnu = dense_ops.adamw_update(
                x, dz, leaves[s.kernel], state[0][0], state[1][0], b, state[0][1], state[1][1], lr,
                count, b1=rule.b1, b2=rule.b2, eps=rule.eps, eps_root=rule.eps_root,
                weight_decay=wd(s.kernel), bias_weight_decay=wd(s.bias), after=previous)
            outs = [(mu, bmu), (nu, bnu)]
        # the next layer's update waits for this one's output gradient, which that layer's
        # backward pass (the other reader of its kernel) makes: XLA need not copy the kernel
        previous = dys[s.kernel]
        new_leaves[s.kernel] = k
        if s.bias is not None:
            new_leaves[s.bias] = bb
        for n, (mk, mb) in zip(new, outs):
            n[s.kernel] = mk
            if s.bias is not None:
                n[s.bias] = mb
    new_state = optax.tree_utils.tree_set(
        new_state, **{name: treedef.unflatten(n) for name, n in zip(names, new)})
    return treedef.unflatten(new_leaves), new_state, ((loss, aux) if has_aux else loss)
