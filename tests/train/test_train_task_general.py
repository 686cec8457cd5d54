"""The harness is task-general: a benchmark defined here alone (a small CNN with
BatchNorm on stock flax layers, NHWC inputs) runs end to end and its log passes the
official checker; the one train step carries model state and a data-parallel axis."""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mlperf_logging.compliance_checker import mlp_compliance

from tiny_benchmark import write_rules

from jax_brgemm.models import MLP
from jax_brgemm.train import SUITE, Benchmark, compliance_config, data, run_benchmark, step, task
from jax_brgemm.train.suite import FASHION_MNIST_SPLITS as SPLITS
from jax_brgemm.train.suite import Suite


class TinyCNN(nn.Module):
    """conv 3x3/2 -> BatchNorm -> relu -> dense, all stock flax layers."""

    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), strides=(2, 2), dtype=self.dtype)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x)
        x = nn.relu(x)
        return nn.Dense(10, dtype=self.dtype)(x.reshape((x.shape[0], -1)))


def _cnn(impl, dtype):
    assert impl == "xla", "the test CNN is built from stock flax layers only"
    return TinyCNN(dtype=dtype)


def cnn_benchmark(dataset) -> Benchmark:
    mlp = SUITE["mlp"]
    common = {**mlp.hparams["common"], "global_batch_size": 64, "opt_base_learning_rate": 0.1,
              "opt_learning_rate_warmup_epochs": 0.5, "opt_learning_rate_decay_epochs": 4.0}
    return Benchmark(
        name="tiny_cnn", description="tiny CNN with BatchNorm (test only)", dataset=dataset,
        pipeline=task.Pipeline(SPLITS, task.normalized_images(0.45, 0.25, "nhwc")),
        model=_cnn, model_state=("batch_stats",), loss=task.softmax_cross_entropy,
        metric=task.TOP1, target=0.8, max_epochs=4, eval_every_epochs=1, eval_batch_size=128,
        num_runs=5, hparams={**mlp.hparams, "common": common}, tunable=mlp.tunable)


@pytest.fixture(scope="module")
def cnn(tiny):
    """The CNN benchmark on the tiny benchmark's data, in a suite of its own whose ruleset
    is generated here."""
    bench = cnn_benchmark(tiny.bench.dataset)
    suite = Suite([bench], rules_dir=tiny.root / "cnn_rules")
    write_rules(suite.rules_dir, [bench])
    return bench, suite, tiny


def test_cnn_benchmark_end_to_end_passes_the_official_checker(cnn):
    bench, suite, tiny = cnn
    summary = run_benchmark(bench, impl="xla", division="open", seed=3, data_dir=tiny.data,
                            log_dir=tiny.root / "cnn_logs", show_progress=False, suite=suite)
    run = summary["runs"][0]
    assert run["status"] == "success" and run["compliance"] is True
    checker = mlp_compliance.make_checker("training", "6.1.0", quiet=False, werror=False)
    assert mlp_compliance.main(run["log_path"], compliance_config(bench.name, suite),
                               checker)[0]


def _state_and_batch(bench, batch_size=16):
    model = bench.model(impl="xla", dtype=None)
    tx = optax.sgd(0.1, momentum=0.9)
    example = bench.pipeline.preprocess(jnp.zeros((1, 28, 28), jnp.uint8))
    state = step.create_state(bench, model, tx, jax.random.key(0), example)
    rng = np.random.default_rng(1)
    weight = np.ones(batch_size, np.float32)
    weight[-3:] = 0.0  # padding rows, all in the second shard
    batch = data.Batch(rng.integers(0, 256, (batch_size, 28, 28)).astype(np.uint8),
                       rng.integers(0, 10, batch_size).astype(np.int32), weight)
    return state, batch


def test_train_step_updates_batch_stats_and_eval_reads_them(cnn):
    bench = cnn[0]
    state, batch = _state_and_batch(bench)
    assert set(state.model_state) == {"batch_stats"}
    new, loss = jax.jit(functools.partial(step.train_step, bench=bench))(state, batch)
    assert np.isfinite(loss)
    before, after = (jax.tree.leaves(s.model_state) for s in (state, new))
    # mean and var moved
    assert all(not np.allclose(a, b) for a, b in zip(before, after, strict=True))
    # Eval uses the running statistics: a row's score does not depend on the batch.
    evaluate = jax.jit(functools.partial(step.eval_step, bench=bench))
    one = data.Batch(batch.inputs[:1], batch.labels[:1], np.ones(1, np.float32))
    per_row = [float(evaluate(new, data.Batch(batch.inputs[i:i + 1], batch.labels[i:i + 1],
                                              np.ones(1, np.float32)))) for i in range(13)]
    assert float(evaluate(new, batch)) == sum(per_row)
    assert float(evaluate(new, one)) == per_row[0]


def _sharded(batch, shards=2):
    return jax.tree.map(lambda x: x.reshape(shards, -1, *x.shape[1:]), batch)


def test_data_parallel_axis_gives_the_single_device_step():
    bench = dataclasses.replace(
        SUITE["mlp"], model=lambda impl, dtype: MLP(features=(32,), num_classes=10, impl=impl))
    state, batch = _state_and_batch(bench)
    single, single_loss = step.train_step(state, batch, bench=bench)
    parallel = jax.vmap(functools.partial(step.train_step, bench=bench, axis_name="data"),
                        in_axes=(None, 0), axis_name="data")
    shards, shard_loss = parallel(state, _sharded(batch))
    np.testing.assert_allclose(shard_loss, [single_loss] * 2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(shards.params),
                    strict=True):
        np.testing.assert_allclose(b, np.stack([a, a]), rtol=1e-5, atol=1e-7)
    evaluate = jax.vmap(functools.partial(step.eval_step, bench=bench, axis_name="data"),
                        in_axes=(None, 0), axis_name="data")
    assert np.all(evaluate(single, _sharded(batch)) == step.eval_step(single, batch, bench=bench))


@pytest.mark.slow  # ~10 s; the data-parallel step runs in the quick tier
def test_data_parallel_axis_averages_batch_stats(cnn):
    bench = cnn[0]
    state, batch = _state_and_batch(bench)
    parallel = jax.vmap(functools.partial(step.train_step, bench=bench, axis_name="data"),
                        in_axes=(None, 0), axis_name="data")
    shards, _ = parallel(state, _sharded(batch))
    per_shard = [step.train_step(state, jax.tree.map(lambda x: x[i], _sharded(batch)),
                                 bench=bench)[0] for i in range(2)]
    for got, *each in zip(*(jax.tree.leaves(s.model_state) for s in (shards, *per_shard)),
                          strict=True):
        np.testing.assert_allclose(got, np.stack([np.mean(each, axis=0)] * 2), rtol=1e-5)
