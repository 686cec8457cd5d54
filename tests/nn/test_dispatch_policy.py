"""accelerate()'s dispatch policy: the layer calls jax_brgemm.accelerate.policy.TABLE names for this
CPU's ISA stay stock (the same program as without the context), the report says why, and
policy=False, jax_brgemm's own modules and the other layer kinds still run on the kernels."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_brgemm as jb
from jax_brgemm.accelerate import policy

pytestmark = pytest.mark.policy

F32_DENSE = ("dense", np.dtype(jnp.float32))


class Net(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x.reshape((x.shape[0], -1)))


def _calls(model, params, x, **kw):
    with jb.accelerate(**kw) as acc:
        y = jax.jit(model.apply)(params, x)
    return {c.layer: c for c in acc.calls}, y


def test_the_table_covers_every_isa_and_names_float32_dense():
    assert set(policy.TABLE) == {"amx", "avx512", "avx2", "generic"}
    # re-measured with asynchronous calls on AVX-512 (Zen 4): the kernels win from 64 rows;
    # the other ISAs keep the line measured with synchronous calls
    assert {isa: entries[F32_DENSE][0] for isa, entries in policy.TABLE.items()} == {
        "amx": 512, "avx512": 64, "avx2": 512, "generic": 512}
    assert not any(kind != "dense" for entries in policy.TABLE.values() for kind, _ in entries)


def test_float32_dense_stays_stock_with_the_reason_and_the_stock_program():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, 6, 3)), jnp.float32)
    model = Net()
    params = model.init(jax.random.key(0), x)
    calls, y = _calls(model, params, x)
    assert calls["Conv"].accelerated
    assert not calls["Dense"].accelerated and "dispatch policy" in calls["Dense"].reason
    with jb.accelerate():
        hlo = jax.jit(model.apply).lower(params, x).as_text()
    assert "jb_conv" in hlo and "jb_fc" not in hlo
    np.testing.assert_allclose(y, model.apply(params, x), rtol=2e-5, atol=2e-5)


def test_policy_false_bfloat16_and_many_rows_run_dense_on_the_kernels():
    x = jnp.ones((2, 6, 6, 3), jnp.float32)
    for model, kw in ((Net(), {"policy": False}), (Net(dtype=jnp.bfloat16), {})):
        params = model.init(jax.random.key(0), x)
        calls, _ = _calls(model, params, x, **kw)
        assert calls["Dense"].accelerated and calls["Conv"].accelerated
    dense = nn.Dense(3)
    line = policy.TABLE[jb.isa()][F32_DENSE][0]  # this CPU's line
    for shape, on_kernels in (((line - 1, 5), False), ((2, line // 2, 5), True), ((line, 5), True),
                              ((1024, 5), True)):
        x = jnp.ones(shape, jnp.float32)  # rows: the leading dims' product
        calls, _ = _calls(dense, dense.init(jax.random.key(0), x), x)
        assert calls["Dense"].accelerated == on_kernels, shape


def test_nnx_linear_and_jax_brgemm_modules_follow_it():
    x = jnp.ones((3, 5), jnp.float32)
    stock = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
    with jb.accelerate() as acc:
        stock(x)
    assert [c.accelerated for c in acc.calls] == [False]
    # jax_brgemm's own module, used on purpose, runs the kernels inside the context too
    ours = jb.nn.Dense(4)
    params = ours.init(jax.random.key(0), x)
    with jb.accelerate():
        hlo = jax.jit(ours.apply).lower(params, x).as_text()
    assert "jb_fc_fwd" in hlo
