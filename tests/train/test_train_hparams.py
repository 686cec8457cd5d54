"""Closed-division hyperparameter validation, optimizers and schedules."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

from jax_brgemm.train import cli, optim
from jax_brgemm.train.hparams import HparamError, OneOf, Range, defaults, resolve
from jax_brgemm.train.suite import SUITE

MLP = SUITE["mlp"]


def _rule(overrides, division="closed"):
    with pytest.raises(HparamError) as e:
        resolve(MLP, overrides, division)
    return e.value.rule, str(e.value)


def test_reference_hyperparameters_are_valid_in_both_divisions():
    for division in ("closed", "open"):
        hp = resolve(MLP, {}, division)
        assert hp == defaults(MLP, MLP.hparams["common"]["opt_name"])


def test_every_closed_optimizer_has_valid_defaults():
    for opt in MLP.tunable:
        if opt != "common":
            assert resolve(MLP, {"opt_name": opt}, "closed")["opt_name"] == opt


def test_rmsprop_refused_in_closed_allowed_in_open():
    rule, message = _rule({"opt_name": "rmsprop"})
    assert rule == "closed/approved-optimizer"
    assert "rmsprop" in message and "closed division" in message
    assert resolve(MLP, {"opt_name": "rmsprop"}, "open")["opt_name"] == "rmsprop"


def test_out_of_range_refused_with_constraint():
    rule, message = _rule({"opt_base_learning_rate": 5.0})
    assert rule == "closed/tunable-constraint"
    assert "opt_base_learning_rate=5.0" in message and "<= 1" in message
    assert resolve(MLP, {"opt_base_learning_rate": 5.0}, "open")["opt_base_learning_rate"] == 5.0
    assert _rule({"global_batch_size": 8})[0] == "closed/tunable-constraint"
    assert _rule({"sgd_opt_momentum": 0.5})[0] == "closed/tunable-constraint"


def test_tunable_values_inside_the_table_are_accepted():
    hp = resolve(MLP, {"opt_name": "adamw", "opt_base_learning_rate": 0.002,
                       "global_batch_size": 512, "opt_adamw_weight_decay": 0.05}, "closed")
    assert hp["opt_adamw_beta_2"] == optim.OPTIMIZERS["adamw"].defaults["opt_adamw_beta_2"]


def test_non_tunable_hyperparameter_must_keep_reference_value():
    rule, message = _rule({"opt_name": "lars", "lars_opt_trust_coefficient": 0.01})
    assert rule == "closed/fixed-hyperparameter" and "reference value 0.001" in message
    assert _rule({"opt_adam_beta_1": 0.8, "opt_name": "adam"})[0] == "closed/fixed-hyperparameter"


@pytest.mark.parametrize("overrides, rule", [
    ({"opt_name": "adagrad"}, "known-optimizer"),
    ({"opt_adamw_weight_decay": 0.01}, "known-hyperparameter"),  # not an sgd key
    ({"global_batch_size": 256.0}, "hyperparameter-type"),
    ({"global_batch_size": "256"}, "hyperparameter-type"),
    ({"sgd_opt_nesterov": 1}, "hyperparameter-type"),
    ({"opt_base_learning_rate": True}, "hyperparameter-type"),
    ({"opt_learning_rate_warmup_epochs": 20.0}, "schedule"),
    ({"opt_learning_rate_decay_schedule": "step"}, "schedule"),
    ({"opt_base_learning_rate": -0.1}, "schedule"),
])
def test_structural_errors_in_both_divisions(overrides, rule):
    for division in ("closed", "open"):
        assert _rule(overrides, division)[0] == rule


def test_poly_power_only_with_the_polynomial_schedule():
    power = "opt_learning_rate_decay_poly_power"
    assert power not in resolve(MLP, {}, "closed")  # the reference schedule is cosine
    rule, message = _rule({power: 2.0})
    assert rule == "known-hyperparameter" and "cosine schedule" in message
    polynomial = {"opt_learning_rate_decay_schedule": "polynomial"}
    assert resolve(MLP, polynomial, "closed")[power] == 2.0
    assert resolve(MLP, {**polynomial, power: 1.5}, "closed")[power] == 1.5
    assert _rule({**polynomial, power: 3.0})[0] == "closed/tunable-constraint"


@pytest.mark.parametrize("value", [["sgd"], {"sgd": 1}, None])
def test_non_scalar_values_are_refused(value):
    for key in ("opt_name", "global_batch_size"):
        assert _rule({key: value})[0] == "hyperparameter-type"


def _hparams_file(tmp_path, overrides):
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(overrides))
    return str(path)


@pytest.mark.parametrize("overrides, rule", [
    ({"opt_name": "rmsprop"}, "closed/approved-optimizer"),
    ({"opt_base_learning_rate": 3.0}, "closed/tunable-constraint"),
])
def test_cli_exits_2_naming_the_rule(tmp_path, capsys, overrides, rule):
    log_dir = tmp_path / "logs"
    code = cli.main(["mlp", "--impl", "xla", "--hparams", _hparams_file(tmp_path, overrides),
                     "--log-dir", str(log_dir), "--data-dir", str(tmp_path / "none")])
    assert code == 2
    assert f"[rule {rule}]" in capsys.readouterr().err
    assert not log_dir.exists()


@pytest.mark.parametrize("content", ["[1, 2]", "{not json"])
def test_cli_rejects_unreadable_hparams_file(tmp_path, capsys, content):
    path = tmp_path / "hp.json"
    path.write_text(content)
    assert cli.main(["mlp", "--impl", "xla", "--hparams", str(path)]) == 2
    assert "hp.json" in capsys.readouterr().err


def test_cli_usage_errors_exit_2(capsys):
    assert cli.main(["mlp", "--impl", "xla", "--runs", "0"]) == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["mlp", "--division", "semi"])
    assert e.value.code == 2


# The same constraint object validates here and renders the checker's CHECK expression.
values = st.one_of(st.integers(-5, 5000), st.floats(-2, 2, allow_nan=False), st.booleans(),
                   st.sampled_from(["sgd", "cosine", ""]))


@settings(max_examples=200, deadline=None)
@given(x=values)
def test_constraint_expressions_agree_with_checks(x):
    constraints = [Range(32, 4096, integer=True), Range(0, 1, lo_open=True), Range(0.8, 0.99),
                   Range(hi=0.5), OneOf([True, False]), OneOf(["sgd", "lars"])]
    for c in constraints:
        assert eval(c.expr("v['value']"), {}, {"v": {"value": x}}) == c.check(x), (c, x)


# ---------------------------------------------------------------- optimizers and schedules


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"Dense_0": {"kernel": jax.random.normal(k1, (8, 4)), "bias": jnp.ones(4)}}


# Settings that suit this small problem (LARS steps kernels by lr * trust * |w| / |g|).
_HP = {"sgd": {"opt_base_learning_rate": 0.05},
       "lars": {"opt_base_learning_rate": 0.1, "lars_opt_trust_coefficient": 0.1},
       "adam": {"opt_base_learning_rate": 0.05}, "adamw": {"opt_base_learning_rate": 0.05},
       "lamb": {"opt_base_learning_rate": 0.05}, "rmsprop": {"opt_base_learning_rate": 0.05}}


@pytest.mark.parametrize("opt", sorted(optim.OPTIMIZERS))
def test_every_optimizer_minimizes_a_regression(opt):
    hp = resolve(MLP, {"opt_name": opt, **_HP[opt],
                       "opt_learning_rate_warmup_epochs": 0.0,
                       "opt_learning_rate_decay_epochs": 50.0}, "open")
    x = jax.random.normal(jax.random.key(1), (32, 8))
    y = x @ jnp.arange(32.0).reshape(8, 4) / 10

    def loss(p):
        return jnp.mean((x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"] - y) ** 2)

    tx = optim.make(hp, steps_per_epoch=4)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    params = _params()
    state, first = tx.init(params), loss(params)
    for _ in range(200):
        params, state = step(params, state)
    assert loss(params) < 0.1 * first, opt


@pytest.mark.parametrize("opt, key", [("sgd", "opt_weight_decay"),
                                      ("adamw", "opt_adamw_weight_decay"),
                                      ("lamb", "opt_lamb_weight_decay_rate"),
                                      ("lars", "lars_opt_weight_decay")])
def test_weight_decay_skips_biases(opt, key):
    hp = resolve(MLP, {"opt_name": opt, key: 0.5, "opt_learning_rate_warmup_epochs": 0.0},
                 "open")
    params = _params()
    tx = optim.make(hp, steps_per_epoch=10)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)  # only decay can move params
    assert float(jnp.abs(updates["Dense_0"]["bias"]).max()) == 0.0
    assert float(jnp.abs(updates["Dense_0"]["kernel"]).max()) > 0.0


@pytest.mark.parametrize("kind", ["cosine", "polynomial"])
def test_schedule_warmup_then_decay(kind):
    hp = {**defaults(MLP, "sgd"), "opt_base_learning_rate": 0.4, "opt_end_learning_rate": 0.01,
          "opt_learning_rate_warmup_epochs": 2.0, "opt_learning_rate_decay_epochs": 10.0,
          "opt_learning_rate_decay_schedule": kind, "opt_learning_rate_decay_poly_power": 2.0}
    lr = optim.schedule(hp, steps_per_epoch=5)
    values = np.array([float(lr(i)) for i in range(60)])
    assert values[0] == 0.0 and np.isclose(values[5], 0.2)  # linear warmup
    assert np.isclose(values[10], 0.4) and values.max() <= 0.4 + 1e-7
    assert np.all(np.diff(values[10:50]) <= 1e-7)  # monotone decay
    assert np.isclose(values[50], 0.01) and np.isclose(values[59], 0.01)
    middle = (0.4 - 0.01) * (0.5 if kind == "cosine" else 0.25) + 0.01
    assert np.isclose(values[30], middle, rtol=1e-3)
