"""A pre-LayerNorm Transformer encoder and a small Vision Transformer, switchable between the
BRGEMM kernels and stock Flax layers with identical parameter trees.

``impl="brgemm"``: the attention on ``jb.dot_product_attention`` and its projections on the FC
kernels (``jax_brgemm.nn.MultiHeadDotProductAttention``), the MLP on ``jax_brgemm.nn.Dense``
with the gelu fused, the ViT's patch embedding on ``jax_brgemm.nn.Conv``. ``impl="xla"``:
``flax.linen.MultiHeadDotProductAttention``, ``Dense`` followed by ``gelu``, ``Conv``.
LayerNorm, dropout, the class token and the position embeddings are stock Flax in both.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import flax.linen as nn
import jax.numpy as jnp

from .layers import activated, layers

POOLINGS = ("cls", "mean")


def _positive(model: str, **values) -> None:
    bad = {k: v for k, v in values.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0}
    if bad:
        raise ValueError(f"{model}: " + ", ".join(f"{k} must be a positive int, got {v!r}"
                                                  for k, v in bad.items()))


def _check_dropout(model: str, rate) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{model}: dropout_rate must be in [0, 1), got {rate!r}")


class EncoderBlock(nn.Module):
    """One pre-LayerNorm block: ``x + Dropout(Attention(LN(x)))``, then
    ``x + Dropout(Dense(gelu(Dense(LN(x)))))``.

    Parameters: ``ln_attention``, ``attention`` (``query`` / ``key`` / ``value`` / ``out``
    as in ``flax.linen.MultiHeadDotProductAttention``), ``ln_mlp``, ``mlp_in``, ``mlp_out``.
    ``dense`` and ``attention_cls`` are the layer classes (``TransformerEncoder`` picks them).
    """

    num_heads: int
    mlp_dim: int
    dense: type
    attention_cls: type
    dropout_rate: float = 0.0
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask=None, train: bool = False):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        drop = lambda y: nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        y = nn.LayerNorm(name="ln_attention", **kw)(x)
        y = self.attention_cls(num_heads=self.num_heads, name="attention", **kw)(y, mask=mask)
        x = x + drop(y)
        y = nn.LayerNorm(name="ln_mlp", **kw)(x)
        y = activated(self.dense, "gelu", features=self.mlp_dim, name="mlp_in", **kw)(y)
        y = self.dense(x.shape[-1], name="mlp_out", **kw)(drop(y))
        return x + drop(y)


class TransformerEncoder(nn.Module):
    """A stack of pre-LayerNorm Transformer blocks (``EncoderBlock``: self-attention and a
    gelu MLP, each after a LayerNorm and added to its input) and a final LayerNorm.

    Inputs ``(batch..., T, D)`` with D divisible by ``num_heads``; outputs the same shape.
    Parameters ``block_0`` ... ``block_<num_layers-1>`` and ``encoder_norm``, identical for
    both implementations.

    Attributes:
      num_layers: blocks.
      num_heads: attention heads (head dim D / num_heads).
      mlp_dim: the MLP's hidden width.
      dropout_rate: dropout on the attention's and the MLP's outputs (and between the MLP's
        layers) when ``train``; the attention weights are never dropped (that would run
        the attention stock).
      impl: ``"brgemm"`` or ``"xla"`` (see the module's docstring).
      dtype: computation dtype (``None``: inferred from inputs and params).
      param_dtype: dtype of the parameters.
      dense, attention: ``flax.linen.Dense`` / ``MultiHeadDotProductAttention``-compatible
        classes; None takes the ones ``impl`` names.

    Call: ``(x, mask=None, train=False)``; ``mask`` is a boolean attention mask
    broadcastable to ``(batch..., num_heads, T, T)`` (``flax.linen.make_attention_mask`` /
    ``make_causal_mask``), True where a query attends to a key.
    """

    num_layers: int
    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    impl: str = "brgemm"
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    dense: Optional[type] = None
    attention: Optional[type] = None

    @nn.compact
    def __call__(self, x, mask=None, train: bool = False):
        name = type(self).__name__
        chosen = layers(self.impl, name)
        _positive(name, num_layers=self.num_layers, num_heads=self.num_heads, mlp_dim=self.mlp_dim)
        _check_dropout(name, self.dropout_rate)
        if x.ndim < 2 or x.shape[-1] % self.num_heads:
            raise ValueError(f"{name}: inputs must be (batch..., T, D) with D divisible by num_heads = "
                             f"{self.num_heads}, got shape {tuple(x.shape)}")
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        for i in range(self.num_layers):
            x = EncoderBlock(self.num_heads, self.mlp_dim, dense=self.dense or chosen.dense,
                             attention_cls=self.attention or chosen.attention,
                             dropout_rate=self.dropout_rate, name=f"block_{i}", **kw)(x, mask, train)
        return nn.LayerNorm(name="encoder_norm", **kw)(x)


class ViT(nn.Module):
    """A small Vision Transformer (Dosovitskiy et al. 2021) for NHWC images: non-overlapping
    patches embedded by a Conv (kernel = stride = patch), a class token or mean pooling,
    learned position embeddings, a ``TransformerEncoder`` and a Dense head.

    Parameters: ``embedding`` (the patch Conv), ``cls`` (``(1, 1, D)``, with
    ``pooling="cls"``), ``pos_embedding`` (``(1, tokens, D)``), ``encoder`` and ``head``,
    identical for both implementations.

    Attributes:
      num_classes: width of the logits.
      patch_size: patch height and width (an int: square); must divide the image's.
      hidden_size: the token width D.
      num_layers, num_heads, mlp_dim, dropout_rate: the encoder's (dropout also after the
        position embeddings).
      pooling: ``"cls"`` (a learned class token prepended, its output classified) or
        ``"mean"`` (the tokens' mean).
      impl, dtype, param_dtype: as ``TransformerEncoder``'s.
      dense, conv, attention: the layer classes; None takes the ones ``impl`` names.

    Call: ``(images, train=False)``, images ``(N, H, W, C)``; returns ``(N, num_classes)``.
    """

    num_classes: int
    patch_size: Union[int, Sequence[int]] = 7
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    mlp_dim: int = 128
    pooling: str = "cls"
    dropout_rate: float = 0.0
    impl: str = "brgemm"
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    dense: Optional[type] = None
    conv: Optional[type] = None
    attention: Optional[type] = None

    @nn.compact
    def __call__(self, images, train: bool = False):
        chosen = layers(self.impl, "ViT")
        patch = self._patch(images)
        _positive("ViT", num_classes=self.num_classes, hidden_size=self.hidden_size)
        if self.pooling not in POOLINGS:
            raise ValueError(f"ViT: pooling must be one of {POOLINGS}, got {self.pooling!r}")
        _check_dropout("ViT", self.dropout_rate)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = (self.conv or chosen.conv)(self.hidden_size, patch, strides=patch, padding="VALID",
                                       name="embedding", **kw)(images)
        n, h, w, d = x.shape
        x = x.reshape(n, h * w, d)
        if self.pooling == "cls":
            cls = self.param("cls", nn.initializers.zeros_init(), (1, 1, d), self.param_dtype)
            x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (n, 1, d)), x], axis=1)
        pos = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1,) + x.shape[1:],
                         self.param_dtype)
        x = nn.Dropout(self.dropout_rate)(x + pos.astype(x.dtype), deterministic=not train)
        x = TransformerEncoder(self.num_layers, self.num_heads, self.mlp_dim, self.dropout_rate,
                               impl=self.impl, dense=self.dense, attention=self.attention,
                               name="encoder", **kw)(x, train=train)
        x = x[:, 0] if self.pooling == "cls" else jnp.mean(x, axis=1)
        return (self.dense or chosen.dense)(self.num_classes, name="head", **kw)(x)

    def _patch(self, images) -> tuple[int, int]:
        """The patch size as (height, width), checked against the images."""
        patch = (self.patch_size,) * 2 if isinstance(self.patch_size, int) else tuple(self.patch_size)
        if len(patch) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in patch):
            raise ValueError(f"ViT: patch_size must be a positive int or a pair of them, got {self.patch_size!r}")
        if images.ndim != 4 or images.shape[1] % patch[0] or images.shape[2] % patch[1]:
            raise ValueError(f"ViT: images must be (N, H, W, C) with H and W divisible by patch_size "
                             f"{patch}, got shape {tuple(images.shape)}")
        return patch
