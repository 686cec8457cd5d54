"""accelerate() and a tied embedding: flax.linen.Embed.attend and flax.nnx.Embed.attend run
on the FC kernels (the table read as stored) and equal stock, values and gradients, fp32 and
bf16, with the lookup's gradient and the logits' summed into one table gradient."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_brgemm as jb
from stock_reference import assert_close


class TiedLM(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(301, 24, dtype=self.dtype)
        return embed.attend(jnp.tanh(embed(tokens)))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 301, (3, 37)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linen_tied_embedding(dtype):
    model = TiedLM(dtype)
    params = model.init(jax.random.key(0), TOKENS)
    step = jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.sin(model.apply(p, TOKENS).astype(jnp.float32)))))
    want = step(params)
    with jb.accelerate(policy=False) as acc:
        got = step(params)
        text = step.lower(params).as_text()
    assert [(c.layer, c.accelerated) for c in acc.calls] == [("Embed.attend", True)], acc.calls
    assert "jb_fc_bwd" in text and "jb_fc_upd" in text
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    assert_close(got[0], want[0], tol)
    assert_close(got[1]["params"]["Embed_0"]["embedding"], want[1]["params"]["Embed_0"]["embedding"], tol)


def test_nnx_attend():
    embed = nnx.Embed(301, 24, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 7, 24)), jnp.float32)

    def loss(embed, x):
        return jnp.sum(jnp.sin(embed.attend(x)))

    want = nnx.value_and_grad(loss, argnums=(0, 1))(embed, x)
    with jb.accelerate(policy=False) as acc:
        got = nnx.value_and_grad(loss, argnums=(0, 1))(embed, x)
    assert [(c.path, c.accelerated) for c in acc.calls] == [("nnx.Embed(301 x 24)", True)], acc.calls
    assert_close(got[0], want[0], 2e-5)
    assert_close(got[1][0].embedding[...], want[1][0].embedding[...], 2e-5)
    assert_close(got[1][1], want[1][1], 2e-5)


def test_unexpected_arguments_stay_stock():
    embed = nnx.Embed(11, 4, rngs=nnx.Rngs(0))
    with jb.accelerate(policy=False) as acc:
        embed.attend(jnp.ones((2, 4)), out_sharding=None)
        with pytest.raises(TypeError):
            embed.attend(jnp.ones((2, 4)), unknown=1)
    assert acc.calls[0].accelerated and acc.calls[1].reason == "unexpected arguments"


def test_gelu_on_the_kernels_while_a_context_is_open():
    """jax.nn.gelu, flax.linen.gelu and flax.nnx.gelu compute their derivative on the kernels
    inside a context, in its thread only; the erf form and small arrays stay jax's; every
    name is jax's own function again afterwards."""
    import threading

    stock = jax.nn.gelu
    x = jnp.asarray(np.random.default_rng(2).standard_normal((6, 40, 80)), jnp.bfloat16)
    grad = lambda g: jax.jit(jax.grad(lambda v: jnp.sum(g(v).astype(jnp.float32))))  # noqa: E731
    with jb.accelerate() as acc:
        texts = [grad(g).lower(x).as_text() for g in (jax.nn.gelu, nn.gelu, nnx.gelu)]
        erf = jax.nn.gelu(x, approximate=False)
        small = grad(jax.nn.gelu).lower(x[:2, :2]).as_text()
        seen = []
        other = threading.Thread(target=lambda: seen.append(grad(jax.nn.gelu).lower(x).as_text()))
        other.start()
        other.join()
    assert all("jb_fc_act_grad" in t for t in texts) and "jb_fc_act_grad" not in seen[0] + small
    np.testing.assert_array_equal(erf, stock(x, approximate=False))
    assert [(c.layer, c.accelerated) for c in acc.calls] == [("jax.nn.gelu", True)]
    assert jax.nn.gelu is stock and nn.gelu is stock and nnx.gelu is stock
