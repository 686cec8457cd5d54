"""The vit benchmark's definition runs in the harness: its model, pipeline, loss and
reference optimizer train on the tiny benchmark's data (a few steps), the two impls take
the same steps, and a run's log passes the official checker with rules generated for it."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_benchmark import write_rules

from jax_brgemm.train import SUITE, compliance_config, data, optim, run_benchmark, step
from jax_brgemm.train.hparams import resolve
from jax_brgemm.train.suite import Suite

VIT = SUITE["vit"]


def _on_tiny_data(tiny):
    """vit on the tiny data: its model, pipeline, loss, metric and optimizer, with a batch,
    a learning rate and epochs for 512 examples (16 steps an epoch)."""
    common = {**VIT.hparams["common"], "global_batch_size": 32, "opt_base_learning_rate": 3e-3,
              "opt_learning_rate_warmup_epochs": 0.5, "opt_learning_rate_decay_epochs": 6.0}
    return dataclasses.replace(VIT, dataset=tiny.bench.dataset, max_epochs=6, target=0.4, eval_batch_size=128,
                               hparams={**VIT.hparams, "common": common}, reference_dir=tiny.reference)


def test_reference_hyperparameters_are_closed_division_valid():
    hp = resolve(VIT, {}, "closed")
    assert hp["opt_name"] == "adamw" and hp["opt_adamw_weight_decay"] == 0.05
    assert VIT.pipeline.preprocess(jnp.zeros((2, 28, 28), jnp.uint8)).shape == (2, 28, 28, 1)


@pytest.mark.slow  # ~12 s; a run that passes the checker is in the quick tier
def test_both_impls_take_the_same_steps(tiny):
    """Three AdamW steps of the benchmark's train step from the same initial state."""
    bench = _on_tiny_data(tiny)
    arrays = data.load(bench.dataset, data.locate(bench.dataset, tiny.data))
    train = bench.pipeline.decode(arrays)["train"]
    batches = list(bench.pipeline.train_batches(train.inputs, train.labels, 64, 0, 1))[:3]
    tx = optim.make(resolve(bench, {}, "open"), steps_per_epoch=8)
    example = bench.pipeline.preprocess(jnp.zeros((1, 28, 28), jnp.uint8))
    results = {}
    for impl in ("brgemm", "xla"):
        state = step.create_state(bench, bench.model(impl=impl, dtype=None), tx, jax.random.key(0), example)
        train_step = jax.jit(functools.partial(step.train_step, bench=bench))
        losses = []
        for batch in batches:
            state, loss = train_step(state, batch)
            losses.append(float(loss))
        results[impl] = (losses, state.params)
    np.testing.assert_allclose(results["brgemm"][0], results["xla"][0], rtol=1e-4)
    assert results["xla"][0][-1] < results["xla"][0][0]
    # The attention's key biases are left out: softmax is invariant to them, so their
    # gradients are rounding noise, which Adam scales up to steps of the learning rate's size.
    flat = {i: jax.tree_util.tree_flatten_with_path(results[i][1])[0] for i in ("brgemm", "xla")}
    compared = 0
    for (path, a), (_, b) in zip(flat["brgemm"], flat["xla"], strict=True):
        if "key" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path):
            continue
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4 * max(1.0, float(np.max(np.abs(b)))),
                                   err_msg=jax.tree_util.keystr(path))
        compared += 1
    assert compared == len(flat["xla"]) - 4  # one key bias per block


def test_a_run_passes_the_official_checker(tiny):
    from mlperf_logging.compliance_checker import mlp_compliance

    bench = _on_tiny_data(tiny)
    suite = Suite([bench], rules_dir=tiny.root / "vit_rules")
    write_rules(suite.rules_dir, [bench])
    summary = run_benchmark(bench, impl="brgemm", division="open", seed=1, data_dir=tiny.data,
                            log_dir=tiny.root / "vit_logs", show_progress=False, suite=suite)
    run = summary["runs"][0]
    assert run["status"] == "success" and run["compliance"] is True
    checker = mlp_compliance.make_checker("training", "6.1.0", quiet=False, werror=False)
    assert mlp_compliance.main(run["log_path"], compliance_config(bench.name, suite), checker)[0]
