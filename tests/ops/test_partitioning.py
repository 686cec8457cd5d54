"""Sharding-aware custom calls: under plain jax.jit with the batch sharded over 2 CPU
devices, the kernels run per shard (no all-gather of activations) and the weight
update's partial sums are all-reduced. Runs in a subprocess with 2 host devices."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

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
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
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


ATTENTION_SCRIPT = textwrap.dedent('''
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    import jax_brgemm as jb
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    rows = NamedSharding(mesh, P("batch"))
    rep = NamedSharding(mesh, P())
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    k = iter(jax.random.split(jax.random.key(1), 8))
    B, T, S, N, K, H = 4, 16, 24, 4, 2, 8  # grouped-query: 2 key/value heads
    q = jax.random.normal(next(k), (B, T, N, H))
    kv = [jax.random.normal(next(k), (B, S, K, H)) for _ in range(2)]
    bias_rows = jax.random.normal(next(k), (B, N, T, S))  # its own batch: split with it
    bias_shared = jax.random.normal(next(k), (N, T, S))   # broadcast over B: replicated
    mask_rows = jax.random.uniform(next(k), (B, 1, T, S)) > 0.2
    mask_shared = mask_rows[0, 0]  # (T, S)

    def losses(attend):
        def loss(q, k, v, bias, mask, causal):
            o = attend(q, k, v, bias, mask, is_causal=causal)
            return jnp.sum(o * jnp.cos(o))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), static_argnums=5)

    jb_f, ref_f = losses(jb.dot_product_attention), losses(jax.nn.dot_product_attention)
    out = {}
    cases = (("rows", bias_rows, mask_rows, False), ("shared", bias_shared, mask_shared, True))
    for name, bias, mask, causal in cases:
        placed = [jax.device_put(a, rows) for a in (q, *kv)]
        placed += [jax.device_put(a, rows if a.ndim == 4 else rep) for a in (bias, mask)]
        hlo = jb_f.lower(*placed, causal).compile().as_text()
        lines = hlo.splitlines()
        value, grads = jb_f(*placed, causal)
        single = jb_f(*[jax.device_put(a, one) for a in placed], causal)
        ref = ref_f(*placed, causal)
        err = lambda a, b: max(float(np.max(np.abs(x - y)) / np.max(np.abs(y)))
                               for x, y in zip(map(np.asarray, jax.tree.leaves(a)),
                                               map(np.asarray, jax.tree.leaves(b)), strict=True))
        out[name] = {
            "all_gathers": [l.strip()[:200] for l in lines if "all-gather" in l],
            "all_reduces": [l.strip()[:300] for l in lines if " all-reduce(" in l],
            "calls": [(re.search(r'custom_call_target="(\\w+)"', l).group(1),
                       re.search(r"= \\(?(\\w+\\[[\\d,]*\\])", l).group(1))
                      for l in lines if 'custom_call_target="jb_' in l],
            "err_vs_single_device": err((value, grads), single),
            "err_vs_stock": err((value, grads), ref),
            "dq_sharding": str(grads[0].sharding.spec),
        }
    # the single-device path: one call over the whole batch, no collectives
    hlo = jb_f.lower(*[jax.device_put(a, one) for a in (q, *kv, bias_shared, mask_rows)], False)
    text = hlo.compile().as_text()
    out["single_calls"] = re.findall(
        r'= \\(?(\\w+\\[[\\d,]*\\]).*custom_call_target="(jb_\\w+)"', text)
    out["single_collectives"] = [l for l in text.splitlines() if "all-" in l]
    # vmap over unbatched (T, N, H) calls takes the plain call's vmap rule
    vq, vk, vv = (jax.device_put(a, rows) for a in (q, *kv))
    vmapped = jax.jit(jax.vmap(jb.dot_product_attention))(vq, vk, vv)
    out["vmap_err"] = float(np.max(np.abs(np.asarray(vmapped)
                                          - np.asarray(jax.nn.dot_product_attention(q, *kv)))))
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.slow  # 18 s; the quick tier shards the other custom calls in the test above
def test_attention_runs_per_batch_shard():
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-c", ATTENTION_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for name in ("rows", "shared"):
        case = out[name]
        assert case["all_gathers"] == [], (name, case["all_gathers"])
        targets = {t for t, _ in case["calls"]}
        assert targets == {"jb_attention_fwd", "jb_attention_bwd"}, case["calls"]
        # every call sees its shard: 2 of the batch's 4 (q, k, v, out and their gradients)
        assert all(s.startswith(("f32[2,", "bf16[2,")) for _, s in case["calls"]), case["calls"]
        assert case["err_vs_single_device"] < 1e-5, (name, case)
        assert case["err_vs_stock"] < 1e-4, (name, case)
        assert "batch" in case["dq_sharding"]
    # a bias with its own batch: no collective but the loss's (a scalar); one shared by the
    # batch: its gradient is each shard's partial sum, all-reduced (bias-sized, (1, N, T, S))
    assert all("f32[] all-reduce" in l for l in out["rows"]["all_reduces"]), out["rows"]
    assert any("f32[1,4,16,24]" in l for l in out["shared"]["all_reduces"]), out["shared"]
    assert sorted(out["single_calls"]) == [["f32[4,16,4,8]", "jb_attention_bwd"],
                                           ["f32[4,16,4,8]", "jb_attention_fwd"]], out
    assert out["single_collectives"] == []
    assert out["vmap_err"] < 1e-5
