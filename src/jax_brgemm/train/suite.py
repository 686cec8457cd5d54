"""The benchmark suite: each benchmark is one ``Benchmark`` value, ``SUITE`` holds them.

A benchmark is data: dataset, input pipeline (decode, preprocessing, batching),
model and model state, loss, metric, target and hyperparameter table; the harness
runs any of them with the same train step (step.py). Adding a benchmark (e.g.
``resnet`` with BatchNorm, or ``lstm`` on row sequences) means adding one definition
below (and a pipeline layout, loss or metric in task.py if it needs a new one), then
``python -m jax_brgemm.train.rulegen --write`` to generate its checker ruleset and
``python -m jax_brgemm.train.reference NAME`` to record its reference runs; nothing
else in the harness knows benchmark names. The harness takes the suite as a parameter
(``SUITE`` by default), so a test passes a suite of its own benchmarks.
"""

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from . import data, scoring, task
from .hparams import OneOf, Range

REFERENCE_DIR = Path(__file__).parent / "reference"
RULES_DIR = Path(__file__).resolve().parent / "rules"


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark of the suite, as data.

    Attributes:
      name: the ``submission_benchmark`` name and CLI argument.
      description: one line for --help and the README.
      dataset: where the data comes from and how it is verified.
      pipeline: how the dataset's files become batches of model inputs.
      model: ``model(impl=..., dtype=...)`` builds the flax module; the reference
        implementation is ``impl="xla"``.
      model_state: variable collections besides ``params`` that the train step
        updates (``mutable``) and evaluation reads, e.g. ``("batch_stats",)``. A model
        with model state takes ``train`` (True in the train step, False in eval).
      loss: ``loss(outputs, labels)`` -> per-example training loss.
      metric: the quality measure, evaluated on the whole eval split.
      target: quality target of the metric.
      max_epochs: a run that has not reached the target after this many epochs is
        stopped and counts as not converged.
      eval_every_epochs: evaluation frequency.
      eval_batch_size: examples per evaluation step (all test examples are used).
      num_runs: runs per result (olympic scoring drops the fastest and slowest).
      hparams: reference hyperparameters: ``"common"`` (includes the reference
        ``opt_name``) plus per-optimizer overrides of optim.OPTIMIZERS defaults.
      tunable: the closed division table: ``"common"`` plus one entry per allowed
        optimizer, each mapping a tunable key to its constraint.
      reference_dir: where the recorded reference runs are (``<name>.json``).
    """

    name: str
    description: str
    dataset: data.Dataset
    pipeline: task.Pipeline
    model: Callable[..., Any]
    loss: Callable[[Any, Any], Any]
    metric: task.Metric
    target: float
    max_epochs: int
    eval_every_epochs: int
    eval_batch_size: int
    num_runs: int
    hparams: Mapping[str, Mapping[str, Any]]
    tunable: Mapping[str, Mapping[str, Any]]
    model_state: Sequence[str] = ()
    reference_dir: Path = REFERENCE_DIR

    @property
    def train_size(self) -> int:
        return self.pipeline.size(self.dataset, "train")

    @property
    def eval_size(self) -> int:
        return self.pipeline.size(self.dataset, "eval")

    def reference(self) -> Optional[dict]:
        """The recorded reference runs (reference/<name>.json), if any."""
        path = Path(self.reference_dir) / f"{self.name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def reference_for(self, kind: str) -> Optional[dict]:
        """The recorded reference runs of CPU kind ``kind`` (loop.cpu_kind()):
        reference/<kind>/<name>.json, or reference/<name>.json if it was recorded on that
        kind; None otherwise (times from another kind of CPU do not compare)."""
        path = Path(self.reference_dir) / kind / f"{self.name}.json"
        if path.exists():
            return json.loads(path.read_text())
        reference = self.reference()
        return reference if reference is not None and reference.get("cpu_kind") == kind else None

    def reference_summary(self, reference: Optional[dict] = None) -> Optional[dict]:
        """What the recorded runs give for the current target: epochs and time to
        target per run, the reference result and the RCP (scoring.reference_summary);
        of ``reference`` if given, else of reference/<name>.json."""
        reference = reference if reference is not None else self.reference()
        if reference is None:
            return None
        return scoring.reference_summary(reference, self.target, self.eval_every_epochs,
                                         self.num_runs)


class Suite(Mapping[str, Benchmark]):
    """Benchmarks by name, and the directory of their compliance checker rules
    (``common.yaml`` and one ``<name>.yaml`` per benchmark, see rulegen.py)."""

    def __init__(self, benchmarks: Iterable[Benchmark], rules_dir: Path = RULES_DIR):
        self._benchmarks = {b.name: b for b in benchmarks}
        self.rules_dir = Path(rules_dir)

    def __getitem__(self, name: str) -> Benchmark:
        return self._benchmarks[name]

    def __iter__(self):
        return iter(self._benchmarks)

    def __len__(self) -> int:
        return len(self._benchmarks)

    def __repr__(self) -> str:
        return f"Suite({sorted(self)}, rules_dir={str(self.rules_dir)!r})"


# The closed division's constraints on the schedule, the same for every optimizer.
_SCHEDULE_TABLE = {
    "global_batch_size": Range(32, 4096, integer=True),
    "opt_learning_rate_warmup_epochs": Range(0, 5),
    "opt_learning_rate_decay_epochs": Range(1, 50),
    "opt_learning_rate_decay_schedule": OneOf(["cosine", "polynomial"]),
    "opt_learning_rate_decay_poly_power": Range(1, 2),  # polynomial schedule only
}

# Each approved optimizer's tunable keys and their constraints in the closed division.
_OPTIMIZER_TABLES = {
    "sgd": {"opt_base_learning_rate": Range(0, 1, lo_open=True),
            "sgd_opt_momentum": Range(0.8, 0.99),
            "sgd_opt_nesterov": OneOf([True, False]),
            "opt_weight_decay": Range(0, 1e-3)},
    "lars": {"opt_base_learning_rate": Range(0, 30, lo_open=True),
             "lars_opt_momentum": Range(0.8, 0.99),
             "lars_opt_weight_decay": Range(0, 1e-3)},
    "adam": {"opt_base_learning_rate": Range(0, 0.01, lo_open=True)},
    "adamw": {"opt_base_learning_rate": Range(0, 0.01, lo_open=True),
              "opt_adamw_weight_decay": Range(0, 0.1)},
    "lamb": {"opt_base_learning_rate": Range(0, 0.05, lo_open=True),
             "opt_lamb_weight_decay_rate": Range(0, 0.1)},
}


def _tunable(*optimizers: str) -> dict:
    """The closed division's table approving ``optimizers``, in the order the rules and
    the error messages list them."""
    return {"common": _SCHEDULE_TABLE, **{opt: _OPTIMIZER_TABLES[opt] for opt in optimizers}}


def _hparams(batch_size: int, opt_name: str, learning_rate: float, warmup_epochs: float,
             decay_epochs: float, **per_optimizer: Mapping[str, Any]) -> dict:
    """Reference hyperparameters: a cosine schedule down to 0 with ``opt_name``, plus
    per-optimizer overrides of optim.OPTIMIZERS's defaults."""
    common = {"global_batch_size": batch_size, "opt_name": opt_name,
              "opt_base_learning_rate": learning_rate, "opt_end_learning_rate": 0.0,
              "opt_learning_rate_warmup_epochs": warmup_epochs,
              "opt_learning_rate_decay_schedule": "cosine",
              "opt_learning_rate_decay_epochs": decay_epochs}
    return {"common": common, **per_optimizer}


def _image_optimizers(sgd_weight_decay: float) -> dict:
    """The image-classification benchmarks' (mlp, resnet) per-optimizer references."""
    return {"sgd": {"sgd_opt_momentum": 0.9, "sgd_opt_nesterov": True,
                    "opt_weight_decay": sgd_weight_decay},
            "lars": {"opt_base_learning_rate": 2.0},
            "adam": {"opt_base_learning_rate": 1e-3},
            "adamw": {"opt_base_learning_rate": 1e-3, "opt_adamw_weight_decay": 1e-2},
            "lamb": {"opt_base_learning_rate": 2e-3, "opt_lamb_weight_decay_rate": 1e-2}}


# Fashion-MNIST's four IDX files as train and eval splits.
FASHION_MNIST_SPLITS = {"train": ("train_images", "train_labels"),
                        "eval": ("test_images", "test_labels")}
# Pixel statistics of the scaled [0, 1] Fashion-MNIST training images.
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530


def _fashion_mnist(layout: str, **fields) -> Benchmark:
    """A classifier of Fashion-MNIST's images laid out as ``layout`` (task.py), trained
    on softmax cross-entropy, scored by top-1 accuracy on the whole test split after
    every epoch; 5 runs a result."""
    return Benchmark(dataset=data.FASHION_MNIST,
                     pipeline=task.Pipeline(FASHION_MNIST_SPLITS, task.normalized_images(
                         FASHION_MNIST_MEAN, FASHION_MNIST_STD, layout)),
                     loss=task.softmax_cross_entropy, metric=task.TOP1, eval_every_epochs=1,
                     eval_batch_size=2000, num_runs=5, **fields)


def _mlp_model(impl, dtype):
    from jax_brgemm.models import MLP

    return MLP(features=(1024, 1024, 1024), num_classes=10, activation="relu", impl=impl,
               dtype=dtype)


def _resnet_model(impl, dtype):
    from jax_brgemm.models.resnet import ResNet, ResNetBlock

    # ResNet-8 for 28x28 images: a 3x3 stem and one basic block per stage at 16, 32 and 64
    # filters (28x28, 14x14, 7x7), global average pooling, 10 logits.
    return ResNet(stage_sizes=[1, 1, 1], block_cls=ResNetBlock, num_classes=10, num_filters=16,
                  small_images=True, impl=impl, dtype=dtype)


def _lstm_model(impl, dtype):
    from jax_brgemm.models import LSTMClassifier

    return LSTMClassifier(features=(128, 128), num_classes=10, impl=impl, dtype=dtype)


def _vit_model(impl, dtype):
    from jax_brgemm.models import ViT

    # 7x7 patches of the 28x28 images: 16 tokens and a class token, width 64, 4 blocks of
    # 4 heads (head dim 16), MLP 128.
    return ViT(num_classes=10, patch_size=7, hidden_size=64, num_layers=4, num_heads=4, mlp_dim=128,
               pooling="cls", impl=impl, dtype=dtype)


def _image_classifier(layout: str, hparams: dict, sgd_weight_decay: float, **fields) -> Benchmark:
    """An image benchmark (mlp, resnet): ``hparams`` (``_hparams``) plus the image
    classifiers' per-optimizer references, and the same five optimizers tunable."""
    hparams = {**hparams, **_image_optimizers(sgd_weight_decay)}
    return _fashion_mnist(layout, hparams=hparams, tunable=_tunable("sgd", "lars", "adam", "adamw", "lamb"),
                          **fields)


MLP = _image_classifier(
    "flat", _hparams(256, "sgd", 0.05, 1.0, 16.0), sgd_weight_decay=0.0,
    name="mlp", description="MLP 784-1024-1024-1024-10 (ReLU) on Fashion-MNIST",
    model=_mlp_model, target=0.90, max_epochs=16)

RESNET = _image_classifier(
    "nhwc", _hparams(128, "sgd", 0.1, 0.5, 8.0), sgd_weight_decay=5e-4,
    name="resnet", description="ResNet-8 (small images, width 16-64, BatchNorm) on Fashion-MNIST",
    model=_resnet_model, model_state=("batch_stats",), target=0.90, max_epochs=8)

LSTM = _fashion_mnist(
    "rows",
    name="lstm",
    description="2 stacked LSTM-128 + Dense on row-sequential Fashion-MNIST (28 steps of 28 pixels)",
    model=_lstm_model,
    target=0.89,
    max_epochs=10,
    hparams=_hparams(256, "adam", 2e-3, 0.0, 10.0,
                     sgd={"opt_base_learning_rate": 0.1, "sgd_opt_momentum": 0.9,
                          "sgd_opt_nesterov": True, "opt_weight_decay": 0.0},
                     adamw={"opt_adamw_weight_decay": 1e-4},
                     lamb={"opt_base_learning_rate": 5e-3, "opt_lamb_weight_decay_rate": 0.0}),
    tunable=_tunable("adam", "sgd", "adamw", "lamb"),
)

VIT = _fashion_mnist(
    "nhwc",
    name="vit",
    description="ViT (7x7 patches, width 64, 4 blocks of 4 heads, MLP 128, class token) on Fashion-MNIST",
    model=_vit_model,
    target=0.87,
    max_epochs=8,
    hparams=_hparams(256, "adamw", 2e-3, 1.0, 8.0,
                     adamw={"opt_adamw_weight_decay": 0.05},
                     lamb={"opt_base_learning_rate": 5e-3, "opt_lamb_weight_decay_rate": 0.05}),
    tunable=_tunable("adamw", "lamb"),
)

SUITE = Suite([MLP, RESNET, LSTM, VIT])
