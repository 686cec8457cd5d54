"""ResNet v1.5 (flax examples/imagenet style), switchable between BRGEMM and stock XLA
convolutions with identical variable trees.

The model takes its layer classes injected (``conv=``, ``dense=``); ``impl="brgemm" | "xla"``
picks ``jax_brgemm.nn.Conv`` / ``Dense`` or ``flax.linen.Conv`` / ``Dense`` when they are
not given. BatchNorm is Flax's in both; ``train=`` switches it between batch statistics
(``mutable=["batch_stats"]``) and the running averages, as in the Flax examples. v1.5: the
bottleneck's stride is on its 3x3 convolution. ``small_images=True`` is the variant for
28x28 inputs: a 3x3 stride-1 stem and no max-pool.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax.numpy as jnp

from .layers import layers

ModuleDef = Any


class _Block(nn.Module):
    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: Tuple[int, int] = (1, 1)

    def _join(self, residual, y, out_filters):
        """The last BatchNorm (zero-initialized scale, so the block starts as the identity),
        a projection shortcut where the shapes differ, the sum and the activation."""
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(out_filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNetBlock(_Block):
    """Basic block: two 3x3 convolutions (ResNet-18 / 34)."""

    @nn.compact
    def __call__(self, x):
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.act(self.norm()(y))
        y = self.conv(self.filters, (3, 3))(y)
        return self._join(x, y, self.filters)


class BottleneckResNetBlock(_Block):
    """Bottleneck block: 1x1, 3x3 (with the stride: v1.5), 1x1 to 4x the filters."""

    @nn.compact
    def __call__(self, x):
        y = self.conv(self.filters, (1, 1))(x)
        y = self.act(self.norm()(y))
        y = self.conv(self.filters, (3, 3), self.strides)(y)
        y = self.act(self.norm()(y))
        y = self.conv(self.filters * 4, (1, 1))(y)
        return self._join(x, y, self.filters * 4)


class ResNet(nn.Module):
    """ResNet v1.5.

    Attributes:
      stage_sizes: blocks per stage.
      block_cls: ``ResNetBlock`` or ``BottleneckResNetBlock``.
      num_classes: width of the logits.
      num_filters: filters of the first stage (doubled every stage).
      dtype: computation dtype.
      act: the activation after every BatchNorm but the last of a block.
      small_images: a 3x3 stride-1 stem and no max-pool (for 28x28 / 32x32 inputs).
      impl: ``"brgemm"`` or ``"xla"``: which layer classes ``conv`` / ``dense`` default to.
      conv: a ``flax.linen.Conv``-compatible class; None takes the one ``impl`` names.
      dense: a ``flax.linen.Dense``-compatible class; None takes the one ``impl`` names.
    """

    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int = 1000
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu
    small_images: bool = False
    impl: str = "brgemm"
    conv: Optional[ModuleDef] = None
    dense: Optional[ModuleDef] = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        impl = layers(self.impl, "ResNet")
        conv = partial(self.conv or impl.conv, use_bias=False, dtype=self.dtype)
        norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                       dtype=self.dtype)
        if self.small_images:
            x = conv(self.num_filters, (3, 3), name="conv_init")(x)
        else:
            x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = self.act(norm(name="bn_init")(x))
        if not self.small_images:
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(self.num_filters * 2 ** i, strides=strides, conv=conv, norm=norm,
                                   act=self.act)(x)
        x = jnp.mean(x, axis=(1, 2))
        x = (self.dense or impl.dense)(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


ResNet18 = partial(ResNet, stage_sizes=[2, 2, 2, 2], block_cls=ResNetBlock)
ResNet34 = partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=ResNetBlock)
ResNet50 = partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=BottleneckResNetBlock)
