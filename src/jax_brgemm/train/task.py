"""What a benchmark computes, as data: its input pipeline, loss and quality metric.

A benchmark (suite.Benchmark) combines these with a dataset (data.Dataset), a
model and its model state; the one train step (step.py) serves every benchmark.
"""

import dataclasses
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import data


class Split(NamedTuple):
    """The decoded examples of one split: raw inputs (e.g. uint8 images) and int32 labels."""

    inputs: np.ndarray
    labels: np.ndarray


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """From a dataset's files to model inputs.

    Attributes:
      splits: ``"train"`` and ``"eval"`` -> (file role of the inputs, file role of the
        labels). Decoding reads those IDX files; labels become int32.
      preprocess: raw batch inputs -> model inputs. It runs inside the compiled steps,
        so it is part of every (timed) step, as per-run preprocessing must be.
      train_batches: ``(inputs, labels, batch_size, seed, epoch)`` -> one epoch of
        fixed-size padded batches (data.Batch), every example once.
      eval_batches: ``(inputs, labels, batch_size)`` -> the whole split in order.
    """

    splits: Mapping[str, tuple[str, str]]
    preprocess: Callable[[jax.Array], jax.Array]
    train_batches: Callable = data.train_batches
    eval_batches: Callable = data.eval_batches

    def decode(self, arrays: Mapping[str, np.ndarray]) -> dict[str, Split]:
        """Split name -> Split, from the loaded files (role -> array, data.load)."""
        return {split: Split(arrays[inputs], arrays[labels].astype(np.int32))
                for split, (inputs, labels) in self.splits.items()}

    def size(self, dataset: data.Dataset, split: str) -> int:
        """Number of examples of ``split``, from the dataset's declared shapes."""
        return dataset.files[self.splits[split][0]].shape[0]

    def synthetic_batch(self, dataset: data.Dataset, batch_size: int) -> data.Batch:
        """Zeros of a batch's shapes and dtypes, for compiling in the untimed init."""
        spec = dataset.files[self.splits["train"][0]]
        return data.Batch(np.zeros((batch_size, *spec.shape[1:]), spec.dtype),
                          np.zeros(batch_size, np.int32), np.ones(batch_size, np.float32))


LAYOUTS = ("flat", "rows", "nhwc")


def normalized_images(mean: float, std: float, layout: str) -> Callable[[jax.Array], jax.Array]:
    """uint8 images (N, H, W) -> float32 ``(pixel / 255 - mean) / std`` laid out as

    ``"flat"`` (N, H*W) for an MLP, ``"rows"`` (N, H, W): a sequence of H rows of W
    pixels for an LSTM, or ``"nhwc"`` (N, H, W, 1) for a convolutional network.
    ``mean`` and ``std`` are statistics of the scaled training images (high-level
    statistics of the dataset are allowed by the rules).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"image layout must be one of {LAYOUTS}, got {layout!r}")

    def preprocess(images):
        x = (images.astype(jnp.float32) / 255.0 - mean) / std
        if layout == "flat":
            return x.reshape(x.shape[0], -1)
        return x[..., None] if layout == "nhwc" else x

    return preprocess


def softmax_cross_entropy(logits, labels):
    """Per-example softmax cross-entropy of integer labels, computed in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


@dataclasses.dataclass(frozen=True)
class Metric:
    """A quality metric: the mean over the evaluation set of a per-example score."""

    name: str
    per_example: Callable[[jax.Array, jax.Array], jax.Array]


def _top1_correct(logits, labels):
    return (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)


TOP1 = Metric("top-1 accuracy", _top1_correct)
