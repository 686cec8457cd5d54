"""Each approved optimizer's optax step equals a direct implementation of the update
rule written in docs/training.md (approved optimizers), over several steps.

w: a parameter, g: its gradient, lr_t: the schedule's rate at step t (from 1),
wd: weight decay, applied (like the trust ratios) to kernels only, not to biases.
"""

import jax
import numpy as np
import optax
import pytest

from jax_brgemm.train import optim
from jax_brgemm.train.hparams import defaults
from jax_brgemm.train.suite import SUITE

STEPS, STEPS_PER_EPOCH = 6, 2


def sgd(w, g, s, lr, hp, kernel):
    """torch.optim.SGD: g' = g + wd*w; v = mu*v + g'; w -= lr * (g' + mu*v if nesterov else v)."""
    g = g + hp["opt_weight_decay"] * w if kernel else g
    s["v"] = hp["sgd_opt_momentum"] * s.get("v", 0.0) + g
    step = g + hp["sgd_opt_momentum"] * s["v"] if hp["sgd_opt_nesterov"] else s["v"]
    return w - lr * step


def _adam_direction(g, s, t, b1, b2, eps):
    s["m"] = b1 * s.get("m", 0.0) + (1 - b1) * g
    s["v"] = b2 * s.get("v", 0.0) + (1 - b2) * g * g
    m_hat, v_hat = s["m"] / (1 - b1 ** t), s["v"] / (1 - b2 ** t)
    return m_hat / (np.sqrt(v_hat) + eps)


def adam(w, g, s, lr, hp, kernel):
    """Adam: w -= lr * m_hat / (sqrt(v_hat) + eps), bias-corrected moments."""
    s["t"] = s.get("t", 0) + 1
    return w - lr * _adam_direction(g, s, s["t"], hp["opt_adam_beta_1"], hp["opt_adam_beta_2"],
                                    hp["opt_adam_epsilon"])


def adamw(w, g, s, lr, hp, kernel):
    """AdamW (decoupled decay): w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd*w)."""
    s["t"] = s.get("t", 0) + 1
    r = _adam_direction(g, s, s["t"], hp["opt_adamw_beta_1"], hp["opt_adamw_beta_2"],
                        hp["opt_adamw_epsilon"])
    return w - lr * (r + hp["opt_adamw_weight_decay"] * w if kernel else r)


def lamb(w, g, s, lr, hp, kernel):
    """LAMB (MLPerf BERT reference): r = m_hat / (sqrt(v_hat) + eps) + wd*w;
    w -= lr * |w| / |r| * r for kernels (ratio 1 if a norm is 0), lr * r otherwise."""
    s["t"] = s.get("t", 0) + 1
    r = _adam_direction(g, s, s["t"], hp["opt_lamb_beta_1"], hp["opt_lamb_beta_2"],
                        hp["opt_lamb_epsilon"])
    if not kernel:
        return w - lr * r
    r = r + hp["opt_lamb_weight_decay_rate"] * w
    w_norm, r_norm = np.linalg.norm(w), np.linalg.norm(r)
    return w - lr * (w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0) * r


def lars(w, g, s, lr, hp, kernel):
    """MLPerf LARS: ratio = eta*|w| / (|g| + wd*|w| + eps) (1 if a norm is 0);
    v = mu*v + lr * ratio * (g + wd*w); w -= v. Biases: v = mu*v + lr*g."""
    if kernel:
        wd, w_norm, g_norm = hp["lars_opt_weight_decay"], np.linalg.norm(w), np.linalg.norm(g)
        ratio = (hp["lars_opt_trust_coefficient"] * w_norm / (g_norm + wd * w_norm
                                                              + hp["lars_epsilon"])
                 if w_norm > 0 and g_norm > 0 else 1.0)
        g = ratio * (g + wd * w)
    s["v"] = hp["lars_opt_momentum"] * s.get("v", 0.0) + lr * g
    return w - s["v"]


RULES = {"sgd": sgd, "adam": adam, "adamw": adamw, "lamb": lamb, "lars": lars}
# Non-zero weight decays and a large LARS trust coefficient, so every term matters.
OVERRIDES = {"sgd": {"opt_weight_decay": 1e-3, "sgd_opt_nesterov": True},
             "adam": {}, "adamw": {"opt_adamw_weight_decay": 0.05},
             "lamb": {"opt_lamb_weight_decay_rate": 0.05},
             "lars": {"lars_opt_weight_decay": 1e-3, "lars_opt_trust_coefficient": 0.02}}


def test_every_approved_optimizer_has_a_written_rule():
    approved = {name for name, o in optim.OPTIMIZERS.items() if o.approved}
    assert approved == set(RULES)
    assert set(SUITE["mlp"].tunable) - {"common"} <= approved


@pytest.mark.parametrize("name", sorted(RULES))
def test_optax_step_equals_the_written_rule(name):
    hp = {**defaults(SUITE["mlp"], name), **OVERRIDES[name]}
    lr = optim.schedule(hp, STEPS_PER_EPOCH)
    rng = np.random.default_rng(0)
    params = {"Dense_0": {"kernel": rng.normal(size=(5, 3)).astype(np.float32),
                          "bias": rng.normal(size=(3,)).astype(np.float32)}}
    tx = optim.make(hp, STEPS_PER_EPOCH)
    state = tx.init(params)
    expected = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
    slots = {"kernel": {}, "bias": {}}
    for t in range(STEPS):
        grads = {"Dense_0": {"kernel": rng.normal(size=(5, 3)).astype(np.float32),
                             "bias": rng.normal(size=(3,)).astype(np.float32)}}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for leaf in ("kernel", "bias"):
            expected["Dense_0"][leaf] = RULES[name](
                expected["Dense_0"][leaf], np.asarray(grads["Dense_0"][leaf], np.float64),
                slots[leaf], float(lr(t)), hp, kernel=leaf == "kernel")
        for leaf in ("kernel", "bias"):
            np.testing.assert_allclose(params["Dense_0"][leaf], expected["Dense_0"][leaf],
                                       rtol=2e-5, atol=1e-6, err_msg=f"{name} {leaf} step {t}")


def test_optax_lars_and_lamb_differ_from_the_mlperf_rules():
    """Why lars and lamb are compositions: optax's own ones compute other trust ratios."""
    for name, stock in (("lars", lambda hp, lr: optax.lars(
            lr, weight_decay=hp["lars_opt_weight_decay"], trust_coefficient=0.02,
            weight_decay_mask=optim.kernel_mask, trust_ratio_mask=optim.kernel_mask,
            momentum=hp["lars_opt_momentum"])),
                        ("lamb", lambda hp, lr: optax.lamb(
            lr, weight_decay=hp["opt_lamb_weight_decay_rate"], mask=optim.kernel_mask))):
        hp = {**defaults(SUITE["mlp"], name), **OVERRIDES[name], "lars_opt_weight_decay": 0.1}
        rng = np.random.default_rng(0)
        params, grads = ({"kernel": rng.normal(size=(4, 2)).astype(np.float32),
                          "bias": rng.normal(size=2).astype(np.float32)} for _ in range(2))
        ours = optim.OPTIMIZERS[name].build(0.1, hp)
        theirs = stock(hp, 0.1)
        ours_update = ours.update(grads, ours.init(params), params)[0]
        theirs_update = theirs.update(grads, theirs.init(params), params)[0]
        assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(ours_update),
                                                         jax.tree.leaves(theirs_update),
                                                         strict=True)), name
