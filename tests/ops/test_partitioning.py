"""Sharding-aware custom calls: under plain jax.jit with the batch sharded over 2 CPU
devices, the kernels run per shard (no all-gather of activations) and the weight
update's partial sums are all-reduced. Runs in a subprocess with 2 host devices."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    import jax_brgemm as jb
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    rows, rep = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    k = iter(jax.random.split(jax.random.key(0), 8))
    x = jax.device_put(jax.random.normal(next(k), (64, 48)), rows)
    w1 = jax.device_put(jax.random.normal(next(k), (48, 32)) * 0.1, rep)
    b1 = jax.device_put(jnp.ones(32), rep)
    w2 = jax.device_put(jax.random.normal(next(k), (32, 16)) * 0.1, rep)
    a = jax.device_put(jax.random.normal(next(k), (8, 3, 16, 24)), rows)
    b = jax.device_put(jax.random.normal(next(k), (3, 24, 8)), rep)

    def loss(p, x, a):
        h = jb.dense(x, p["w1"], p["b1"], activation="gelu")
        y = jb.dense(h, p["w2"])
        return jnp.sum(y ** 2) + jnp.sum(jb.brgemm(a, p["b"]) ** 2)

    def ref(p, x, a):
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        return jnp.sum((h @ p["w2"]) ** 2) + jnp.sum(jnp.einsum("nbmk,bkj->nmj", a, p["b"]) ** 2)

    params = {"w1": w1, "b1": b1, "w2": w2, "b": b}
    # gradients by data (x, a) too: the backward-by-data runs per shard
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    hlo = f.lower(params, x, a).compile().as_text()
    calls = [l for l in hlo.splitlines() if "custom_call_target=\\"jb_" in l]
    out = {
        "all_gathers": [l.strip()[:200] for l in hlo.splitlines() if "all-gather" in l],
        "all_reduces": [l.strip()[:300] for l in hlo.splitlines() if " all-reduce(" in l],
        "calls": [(re.search(r'custom_call_target="(\\w+)"', l).group(1),
                   re.search(r"= \\(?(\\w+\\[[\\d,]*\\])", l).group(1)) for l in calls],
    }
    v, g = f(params, x, a)
    v2, g2 = jax.value_and_grad(ref, argnums=(0, 1, 2))(params, x, a)
    out["rel_err"] = max(float(jnp.max(jnp.abs(p - q)) / jnp.max(jnp.abs(q)))
                         for p, q in zip(jax.tree.leaves((v, g)), jax.tree.leaves((v2, g2)), strict=True))
    out["dx_sharding"] = str(g[1].sharding.spec)
    print("RESULT " + json.dumps(out))
''')


def test_custom_calls_run_per_shard_without_all_gather():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["all_gathers"] == [], out["all_gathers"]
    shapes = {}
    for target, shape in out["calls"]:
        shapes.setdefault(target, []).append(shape)
    # every call sees its shard: 32 of the 64 rows, 4 of the 8 leading brgemm dims
    assert all(s.startswith("f32[32,") for s in shapes["jb_fc_fwd"]), shapes
    assert all(s.startswith("f32[32,") for s in shapes["jb_fc_bwd"]), shapes
    assert all(s.startswith("f32[32,") for s in shapes["jb_fc_act_grad"]), shapes
    assert all(s.startswith("f32[4,") for s in shapes["jb_brgemm"]), shapes
    # the weight updates are per-shard partials reduced by a collective: weight-sized
    assert set(shapes["jb_fc_upd"]) == {"f32[48,32]", "f32[32,16]"}, shapes
    assert out["all_reduces"] and any("f32[48,32]" in l for l in out["all_reduces"])
    assert out["rel_err"] < 1e-5
    assert "batch" in out["dx_sharding"]
