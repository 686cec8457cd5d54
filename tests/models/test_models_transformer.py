"""Transformer models: TransformerEncoder and ViT build identical parameter trees for both
impls and give stock Flax's outputs and gradients with impl="brgemm" (fp32 and bf16, odd
sizes, both poolings, train and eval); jb.nn.MultiHeadDotProductAttention against stock
flax.linen.MultiHeadDotProductAttention with the same parameters; clear errors on bad fields."""

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb
from jax_brgemm import models

RNG = np.random.default_rng(0)


def normal(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


def custom_calls(f, *args) -> collections.Counter:
    return collections.Counter(re.findall(r"custom_call @(jb_\w+)", jax.jit(f).lower(*args).as_text()))


def assert_close(got, want, tol):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.max(np.abs(b)))))


def init(model, *args, **kw):
    """The model's variables (jitted: one compilation rather than one per operation; an rbg
    key: threefry's bits take longer to compile than the rest of a test)."""
    return jax.jit(lambda: model.init(jax.random.key(1, impl="rbg"), *args, **kw))()


def value_and_grads(model, variables, *args, rngs=None, **kw):
    """The sum of sin(outputs) and its gradients in the parameters and the first input."""
    def f(params, x, *rest):
        y = model.apply({"params": params}, x, *rest, rngs=rngs, **kw)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(variables["params"], *args)


def both(make, x, *args, tol, rngs=None, **kw):
    """make(impl)'s value and gradients, brgemm against xla on the xla model's parameters;
    returns brgemm's kernel calls."""
    ours, stock = make("brgemm"), make("xla")
    variables = init(stock, x, *args, **kw)
    assert jax.eval_shape(lambda: ours.init(jax.random.key(1), x, *args, **kw)) == \
        jax.eval_shape(lambda: variables)
    want = value_and_grads(stock, variables, x, *args, rngs=rngs, **kw)
    got = value_and_grads(ours, variables, x, *args, rngs=rngs, **kw)
    assert_close(got, want, tol)
    return custom_calls(lambda p, x: ours.apply(p, x, *args, rngs=rngs, **kw), variables, x)


# --- parameter trees --------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_vit_parameter_trees_identical(pooling):
    x = jnp.ones((1, 28, 28, 1))
    trees = [jax.eval_shape(models.ViT(num_classes=10, pooling=pooling, impl=impl).init, jax.random.key(0), x)
             for impl in ("brgemm", "xla")]
    assert trees[0] == trees[1]
    params = trees[0]["params"]
    assert ("cls" in params) == (pooling == "cls")
    assert params["pos_embedding"].shape == (1, 16 + (pooling == "cls"), 64)
    assert params["embedding"]["kernel"].shape == (7, 7, 1, 64)
    assert sorted(params["encoder"]) == [f"block_{i}" for i in range(4)] + ["encoder_norm"]
    assert params["encoder"]["block_0"]["attention"]["query"]["kernel"].shape == (64, 4, 16)


def test_encoder_parameters_are_flax_modules_own():
    """The block's attention is a stock MultiHeadDotProductAttention parameter tree: a stock
    module with a block's attention parameters computes on them."""
    enc = models.TransformerEncoder(num_layers=2, num_heads=2, mlp_dim=12, impl="brgemm")
    x = normal(2, 5, 8)
    params = jax.eval_shape(lambda: enc.init(jax.random.key(0), x))["params"]
    stock = nn.MultiHeadDotProductAttention(num_heads=2)
    assert {"params": params["block_1"]["attention"]} == jax.eval_shape(lambda: stock.init(jax.random.key(0), x))


# --- brgemm against xla ------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_vit_fp32_odd_sizes_eval(pooling):
    """15x10 images in (5, 5) patches (6 tokens), width 20 over 4 heads (head dim 5), MLP 37."""
    make = lambda impl: models.ViT(num_classes=7, patch_size=5, hidden_size=20, num_layers=1, num_heads=4,
                                   mlp_dim=37, pooling=pooling, impl=impl)
    calls = both(make, normal(3, 15, 10, 2), tol=1e-4)
    assert calls["jb_attention_fwd"] == 1 and calls["jb_conv_fwd"] == 1
    assert calls["jb_fc_fwd"] == 6 + 1  # q, k, v, out and the MLP's two; the head


def test_vit_train_mode_with_dropout():
    """train=True with dropout: the same dropout masks (same rng, same module paths) for both.
    (An rbg key: threefry's bits take longer to compile than the rest of the test.)"""
    make = lambda impl: models.ViT(num_classes=5, patch_size=(4, 2), hidden_size=12, num_layers=1, num_heads=3,
                                   mlp_dim=16, dropout_rate=0.2, impl=impl)
    x = normal(2, 8, 6, 1)
    rngs = {"dropout": jax.random.key(3, impl="rbg")}
    both(make, x, tol=1e-4, rngs=rngs, train=True)
    # and dropout is on: train and eval differ
    model = make("xla")
    variables = init(model, x)
    train = jax.jit(lambda v, x, train: model.apply(v, x, train=train, rngs=rngs), static_argnums=2)
    assert not np.allclose(train(variables, x, True), train(variables, x, False))


def test_vit_bfloat16():
    """dtype=bfloat16: close to the float32 model on the same parameters, and the gradients
    close to stock's in bfloat16 (the kernels' softmax is float32, Flax's bfloat16)."""
    x = normal(4, 14, 14, 1)
    kw = dict(num_classes=10, patch_size=7, hidden_size=32, num_layers=1, num_heads=4, mlp_dim=48)
    f32 = models.ViT(impl="xla", **kw)
    variables = init(f32, x)
    want = jax.jit(f32.apply)(variables, x)
    got = jax.jit(models.ViT(impl="brgemm", dtype=jnp.bfloat16, **kw).apply)(variables, x)
    assert got.dtype == jnp.bfloat16
    assert_close(got, want, 5e-2)
    grads = {impl: value_and_grads(models.ViT(impl=impl, dtype=jnp.bfloat16, **kw), variables, x)
             for impl in ("brgemm", "xla")}
    assert_close(grads["brgemm"], grads["xla"], 6e-2)


@pytest.mark.parametrize("mask_kind", ["causal", "padding"])
def test_encoder_with_masks(mask_kind):
    x = normal(2, 9, 24)
    if mask_kind == "causal":
        mask = nn.make_causal_mask(jnp.ones((2, 9)))
    else:
        mask = nn.make_attention_mask(jnp.ones((2, 9)), jnp.arange(9)[None] < jnp.array([[9], [4]]))
    layers = 2 if mask_kind == "causal" else 1  # one stack of two blocks: the blocks chain
    make = lambda impl: models.TransformerEncoder(num_layers=layers, num_heads=3, mlp_dim=40, impl=impl)
    calls = both(make, x, mask, tol=1e-4)
    assert calls["jb_attention_fwd"] == layers


# --- jb.nn.MultiHeadDotProductAttention against stock ------------------------------------


def mha_pair(**fields):
    return jb.nn.MultiHeadDotProductAttention(**fields), nn.MultiHeadDotProductAttention(**fields)


def check_mha(fields, args, tol=2e-5, on_kernels=True, **kw):
    ours, stock = mha_pair(**fields)
    params = init(stock, *args, **kw)
    assert jax.eval_shape(lambda: ours.init(jax.random.key(1), *args, **kw)) == jax.eval_shape(lambda: params)

    def vg(module):
        f = lambda p, *a: jnp.sum(jnp.sin(module.apply(p, *a, **kw)))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, *args)

    assert_close(vg(ours), vg(stock), tol)
    calls = custom_calls(lambda p, *a: ours.apply(p, *a, **kw), params, *args)
    assert (calls["jb_attention_fwd"], calls["jb_fc_fwd"]) == ((1, 4) if on_kernels else (0, 4))


@pytest.mark.parametrize("mask_kind", [None, "causal", "padding"])
def test_mha_self_attention(mask_kind):
    x = normal(2, 11, 30)
    mask = None
    if mask_kind == "causal":
        mask = nn.make_causal_mask(jnp.ones((2, 11)))
    elif mask_kind == "padding":
        mask = nn.make_attention_mask(jnp.ones((2, 11)), jnp.asarray(RNG.random((2, 11)) > 0.4))
    check_mha(dict(num_heads=5), (x,), mask=mask)


def test_mha_cross_attention_batch_dims_and_own_widths():
    q, kv = normal(2, 3, 7, 12), normal(2, 3, 13, 9)
    check_mha(dict(num_heads=2, qkv_features=20, out_features=6, normalize_qk=True), (q, kv))


def test_mha_separate_key_and_value_inputs():
    q, k, v = normal(2, 5, 16), normal(2, 6, 16), normal(2, 6, 16)
    check_mha(dict(num_heads=4, use_bias=False), (q, k, v))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_mha_attention_dropout_on_the_kernels(impl):
    """Dropout on the attention weights runs in the attention kernel, with the mask stock
    draws (threefry keys: drawn on the kernels; other generators: JAX's own bits, packed);
    the projections stay on the FC kernels."""
    x = normal(2, 6, 8)
    rngs = {"dropout": jax.random.key(5, impl=impl)}
    ours, stock = mha_pair(num_heads=2, dropout_rate=0.3, deterministic=False)
    params = jax.jit(lambda: stock.init({"params": jax.random.key(0), **rngs}, x))()
    apply = lambda module: jax.jit(lambda p, x: module.apply(p, x, rngs=rngs))(params, x)
    assert_close(apply(ours), apply(stock), 2e-5)
    calls = custom_calls(lambda p, x: ours.apply(p, x, rngs=rngs), params, x)
    assert calls["jb_attention_fwd"] == 1 and calls["jb_fc_fwd"] == 4
    assert calls.get("jb_bernoulli", 0) == (impl == "threefry2x32")


def test_mha_decode_cache_matches_stock():
    """decode=True: step by step through the key / value cache, as the stock module."""
    x = normal(2, 4, 8)
    ours, stock = mha_pair(num_heads=2, decode=True)
    variables = init(stock, x)
    caches = {m: variables["cache"] for m in ("ours", "stock")}
    steps = {name: jax.jit(lambda v, x, module=module: module.apply(v, x, mutable=["cache"]))
             for name, module in (("ours", ours), ("stock", stock))}
    for t in range(4):
        outs = {}
        for name, one_step in steps.items():
            outs[name], new = one_step({"params": variables["params"], "cache": caches[name]}, x[:, t:t + 1])
            caches[name] = new["cache"]
        assert_close(outs["ours"], outs["stock"], 2e-5)


def test_mha_bfloat16():
    x = normal(2, 10, 16)
    ours, stock = mha_pair(num_heads=4, dtype=jnp.bfloat16)
    params = init(stock, x)
    got, want = jax.jit(ours.apply)(params, x), jax.jit(stock.apply)(params, x)
    assert got.dtype == jnp.bfloat16
    assert_close(got, want, 3e-2)


# --- bad fields ----------------------------------------------------------------------------

BAD_VIT = [
    (dict(pooling="max"), "pooling"),
    (dict(patch_size=5), "patch_size"),  # does not divide 28
    (dict(patch_size=(7, 0)), "patch_size"),
    (dict(impl="cuda"), "impl"),
    (dict(hidden_size=30), "num_heads"),  # 30 not divisible by 4 heads
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_layers=0), "num_layers"),
    (dict(mlp_dim=-1), "mlp_dim"),
    (dict(dropout_rate=1.0), "dropout_rate"),
]


@pytest.mark.parametrize("fields, word", BAD_VIT, ids=[w + str(i) for i, (_, w) in enumerate(BAD_VIT)])
def test_vit_bad_fields(fields, word):
    with pytest.raises(ValueError, match=word):
        jax.eval_shape(models.ViT(num_classes=10, **fields).init, jax.random.key(0), jnp.ones((1, 28, 28, 1)))


def test_vit_rejects_non_image_inputs():
    with pytest.raises(ValueError, match=r"\(N, H, W, C\)"):
        jax.eval_shape(models.ViT(num_classes=10).init, jax.random.key(0), jnp.ones((1, 28, 28)))


def test_encoder_bad_fields():
    with pytest.raises(ValueError, match="num_heads"):
        jax.eval_shape(models.TransformerEncoder(num_layers=1, num_heads=0, mlp_dim=8).init,
                       jax.random.key(0), normal(1, 3, 8))
    with pytest.raises(ValueError, match="impl"):
        jax.eval_shape(models.TransformerEncoder(num_layers=1, num_heads=2, mlp_dim=8, impl="gpu").init,
                       jax.random.key(0), normal(1, 3, 8))
