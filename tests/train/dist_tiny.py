"""A tiny benchmark for multi-process tests, and the worker entry point that registers it.

``python tests/dist_tiny.py ROOT BENCHMARK-ARGS...`` registers the tiny benchmark whose
data and rules are in ROOT (written by ``prepare(ROOT)``) and runs the CLI; with
``--processes N`` the launcher starts N copies of that same command, so every worker
has the tiny benchmark too.
"""

import dataclasses
import gzip
import hashlib
import shutil
import sys
from pathlib import Path

import numpy as np

NAMES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
         "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
SIZES = {"train": 512, "test": 300}


def prepare(root: Path) -> None:
    """Writes the generated data (class c brightens rows 2c..2c+2) and the tiny rules."""
    root = Path(root)
    rng = np.random.default_rng(0)
    (root / "data").mkdir(parents=True)
    for split, n in SIZES.items():
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 200, (n, 28, 28))
        for i, c in enumerate(labels):
            images[i, 2 * c:2 * c + 3, :] += 50
        for role, array in ((f"{split}_images", images), (f"{split}_labels", labels)):
            array = array.astype(np.uint8)
            payload = bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
            (root / "data" / (NAMES[role] + ".gz")).write_bytes(
                gzip.compress(payload + array.tobytes()))
    from jax_brgemm.train import compliance, rulegen

    (root / "rules").mkdir()
    shutil.copy(compliance.RULES_DIR / "common.yaml", root / "rules")
    bench = benchmark(root)
    (root / "rules" / "tiny.yaml").write_text(rulegen.render(bench))
    (root / "rules" / "tiny_never.yaml").write_text(
        rulegen.render(dataclasses.replace(bench, name="tiny_never", target=1.01)))


def _tiny_model(impl, dtype):
    from jax_brgemm.models import MLP

    return MLP(features=(32,), num_classes=10, impl=impl, dtype=dtype)


def benchmark(root: Path):
    from jax_brgemm.train import data, suite

    files = {}
    for role, name in NAMES.items():
        payload = gzip.decompress((Path(root) / "data" / (name + ".gz")).read_bytes())
        shape = tuple(int(d) for d in np.frombuffer(payload, ">u4", payload[3], offset=4))
        files[role] = data.IdxFile(name, hashlib.sha256(payload).hexdigest(), shape)
    dataset = dataclasses.replace(data.FASHION_MNIST, name="tiny", files=files, mirrors=(),
                                  system_dir=None, system_package=None)
    mlp = suite.SUITE["mlp"]
    # 0.05 as in test_train_e2e: every seed reaches the target (at 0.2 some diverged).
    common = {**mlp.hparams["common"], "global_batch_size": 64, "opt_base_learning_rate": 0.05,
              "opt_learning_rate_warmup_epochs": 0.5, "opt_learning_rate_decay_epochs": 4.0}
    return dataclasses.replace(mlp, name="tiny", description="tiny test MLP", dataset=dataset,
                               model=_tiny_model, target=0.8, max_epochs=4, eval_batch_size=128,
                               hparams={**mlp.hparams, "common": common})


def register(root: Path) -> None:
    """Registers "tiny" and "tiny_never" (target 1.01, 200 epochs: runs until stopped);
    with $JB_TEST_PARAMS, each process saves its final parameters to
    $JB_TEST_PARAMS.<process index>.npz."""
    import os

    from jax_brgemm.train import compliance, loop, suite

    suite.SUITE["tiny"] = benchmark(root)
    suite.SUITE["tiny_never"] = dataclasses.replace(benchmark(root), name="tiny_never",
                                                    target=1.01, max_epochs=200)
    compliance.RULES_DIR = Path(root) / "rules"
    if os.environ.get("JB_TEST_PARAMS"):
        def save(state):
            import jax

            from jax_brgemm.train import distributed

            leaves = [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(state.params)]
            np.savez(f"{os.environ['JB_TEST_PARAMS']}.{distributed.process_index()}.npz",
                     *leaves)
        loop.on_run_end = save


if __name__ == "__main__":
    register(Path(sys.argv[1]))
    from jax_brgemm.train import cli

    # sys.argv keeps ROOT in front: --processes re-runs this same command line.
    sys.exit(cli.main(sys.argv[2:], worker_command=[sys.executable, __file__, sys.argv[1]]))
