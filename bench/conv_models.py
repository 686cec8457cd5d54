"""Stock flax.linen models of today's convolution kinds, written as people write them, for
bench/bench_accelerate.py (28x28 single-channel images in, 10 logits out):

* MobileNetV2: inverted residual blocks (1x1 expansion by 6, depthwise 3x3, 1x1 projection,
  BatchNorm, relu6), strided depthwise downsampling;
* ConvNeXt: a strided stem, blocks of depthwise 7x7, LayerNorm, a GELU MLP of 4x (Dense over
  the channels), residual; a strided 2x2 downsampling convolution between two stages;
* ResNeXt: bottleneck blocks whose 3x3 convolution has 32 groups (4 channels each),
  BatchNorm, relu, projection shortcuts;
* UNet: two strided 3x3 convolutions down, ConvTranspose 2x2 stride 2 up, skip
  concatenations, a 1x1 head whose per-pixel logits are averaged.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class Model(nn.Module):
    """A benchmark model built of stock Flax layers, computing in `dtype`."""

    dtype: object = None


class MobileNetV2(Model):
    @nn.compact
    def __call__(self, x, train=True):
        norm = lambda: nn.BatchNorm(use_running_average=not train, dtype=self.dtype)  # noqa: E731
        x = nn.relu6(norm()(nn.Conv(16, (3, 3), use_bias=False, dtype=self.dtype)(x)))
        for features, stride in ((24, 2), (24, 1), (32, 2), (32, 1)):
            hidden = 6 * x.shape[-1]
            y = nn.relu6(norm()(nn.Conv(hidden, (1, 1), use_bias=False, dtype=self.dtype)(x)))
            y = nn.Conv(hidden, (3, 3), stride, feature_group_count=hidden, use_bias=False, dtype=self.dtype)(y)
            y = norm()(nn.Conv(features, (1, 1), use_bias=False, dtype=self.dtype)(nn.relu6(norm()(y))))
            x = x + y if x.shape == y.shape else y
        x = nn.relu6(norm()(nn.Conv(128, (1, 1), use_bias=False, dtype=self.dtype)(x)))
        return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


class ConvNeXtBlock(Model):
    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        y = nn.Conv(c, (7, 7), feature_group_count=c, dtype=self.dtype)(x)
        y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(y)
        y = nn.Dense(c, dtype=self.dtype)(nn.gelu(nn.Dense(4 * c, dtype=self.dtype)(y)))
        return x + y


class ConvNeXt(Model):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(nn.Conv(48, (2, 2), 2, dtype=self.dtype)(x))
        for stage, features in enumerate((48, 96)):
            if stage:
                x = nn.Conv(features, (2, 2), 2, dtype=self.dtype)(nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(x))
            for _ in range(2):
                x = ConvNeXtBlock(self.dtype)(x)
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))
        return nn.Dense(10, dtype=self.dtype)(x)


class ResNeXt(Model):
    @nn.compact
    def __call__(self, x, train=True):
        norm = lambda: nn.BatchNorm(use_running_average=not train, dtype=self.dtype)  # noqa: E731
        x = nn.relu(norm()(nn.Conv(64, (3, 3), use_bias=False, dtype=self.dtype)(x)))
        for features, stride in ((128, 1), (256, 2)):
            y = nn.relu(norm()(nn.Conv(features, (1, 1), use_bias=False, dtype=self.dtype)(x)))
            y = nn.Conv(features, (3, 3), stride, feature_group_count=32, use_bias=False, dtype=self.dtype)(y)
            y = norm()(nn.Conv(features, (1, 1), use_bias=False, dtype=self.dtype)(nn.relu(norm()(y))))
            x = norm()(nn.Conv(features, (1, 1), stride, use_bias=False, dtype=self.dtype)(x))
            x = nn.relu(x + y)
        return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


class UNet(Model):
    @nn.compact
    def __call__(self, x, train=True):
        conv = lambda f, s=1: nn.Conv(f, (3, 3), s, dtype=self.dtype)  # noqa: E731
        skips = []
        for features in (32, 64):
            x = nn.relu(conv(features)(x))
            skips.append(x)
            x = nn.relu(conv(2 * features, 2)(x))
        x = nn.relu(conv(128)(x))
        for features, skip in zip((64, 32), skips[::-1]):
            x = nn.relu(nn.ConvTranspose(features, (2, 2), (2, 2), dtype=self.dtype)(x))
            x = nn.relu(conv(features)(jnp.concatenate([x, skip], axis=-1)))
        return jnp.mean(nn.Conv(10, (1, 1), dtype=self.dtype)(x), axis=(1, 2))
