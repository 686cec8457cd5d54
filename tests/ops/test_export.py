"""jax.export of a model on the kernels: exported, serialized, deserialized and called."""

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_brgemm as jb


class Net(fnn.Module):
    @fnn.compact
    def __call__(self, x):
        x = jb.nn.Dense(16, activation="gelu")(x)
        return jb.nn.Dense(3, dtype=jnp.bfloat16)(x)


def test_export_serialize_call():
    x = jax.random.normal(jax.random.key(0), (5, 7))
    net = Net()
    params = net.init(jax.random.key(1), x)
    f = jax.jit(net.apply)
    exported = jax.export.export(f, disabled_checks=jb.export_safety_checks())(params, x)
    assert "jb_fc_fwd" in exported.mlir_module()
    blob = exported.serialize()
    restored = jax.export.deserialize(blob)
    np.testing.assert_array_equal(np.asarray(restored.call(params, x), np.float32),
                                  np.asarray(f(params, x), np.float32))
    # and inside a jitted function of its own, with other inputs of the same shapes
    x2 = 2 * x
    np.testing.assert_array_equal(np.asarray(jax.jit(restored.call)(params, x2), np.float32),
                                  np.asarray(f(params, x2), np.float32))


def test_export_refuses_the_kernels_without_the_disabled_checks():
    f = jax.jit(lambda x, w: jb.dense(x, w))
    with pytest.raises(ValueError, match="jb_fc_fwd"):
        jax.export.export(f)(jnp.ones((2, 3)), jnp.ones((3, 4)))


def test_safety_checks_cover_every_target():
    checks = jb.export_safety_checks()
    assert len(checks) == len(jb._native.TARGETS) and len(checks) >= 6
    assert all(isinstance(c, jax.export.DisabledSafetyCheck) for c in checks)
    # every op's targets are covered: brgemm (plain and accumulating) and the FC passes
    a = jnp.ones((2, 3, 4))
    g = jax.jit(jax.grad(lambda a, c: jnp.sum(jb.brgemm(a, a.swapaxes(1, 2), c)), (0, 1)))
    jax.export.export(g, disabled_checks=checks)(a, jnp.ones((3, 3)))
