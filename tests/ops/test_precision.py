"""precision=: every op takes what lax.dot_general takes (and follows
jax.default_matmul_precision), maps it to an accuracy by JAX's own equivalences, meets every
one with exact float32 products, and refuses what it cannot compute, naming the argument."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jax_brgemm as jb
from jax_brgemm import precision

P, A = lax.Precision, lax.DotAlgorithmPreset
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((5, 33)), jnp.float32)
W = jnp.asarray(RNG.standard_normal((33, 7)), jnp.float32)

TAKEN = [
    (None, "float32"), (P.DEFAULT, "float32"), ("bfloat16", "float32"), ("default", "float32"),
    (P.HIGHEST, "float32"), ("float32", "float32"), ("highest", "float32"), (A.F32_F32_F32, "float32"),
    (P.HIGH, "bf16_3x"), ("high", "bf16_3x"), ("bfloat16_3x", "bf16_3x"), ("tensorfloat32", "bf16_3x"),
    ("BF16_BF16_F32_X3", "bf16_3x"), (A.TF32_TF32_F32, "bf16_3x"), (A.BF16_BF16_F32_X6, "bf16_6x"),
    (A.BF16_BF16_F32, "bf16"), ((P.HIGH, P.HIGH), "bf16_3x"), (("highest", P.HIGHEST), "float32"),
]
REFUSED = [("F16_F16_F32", "algorithm the kernels do not compute"), (A.ANY_F8_ANY_F8_F32, "do not compute"),
           ("fast", "must be None"), (3, "must be None"), ((P.HIGH, P.DEFAULT), "different precisions"),
           ((P.HIGH,), "a pair")]


@pytest.mark.parametrize("value,accuracy", TAKEN)
def test_jax_names_map_to_their_accuracy_and_run_exact_float32(value, accuracy):
    assert precision.accuracy(value, "op") == accuracy
    want = jnp.dot(X, W, precision=P.HIGHEST)
    np.testing.assert_allclose(jb.dense(X, W, precision=value), want, rtol=2e-6, atol=2e-6)
    b = jb.brgemm(X[None], W[None], precision=value)
    np.testing.assert_allclose(b, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("value,message", REFUSED)
def test_what_the_kernels_cannot_compute_is_refused_naming_the_argument(value, message):
    q = jnp.ones((1, 4, 2, 8))
    calls = (lambda: jb.dense(X, W, precision=value), lambda: jb.brgemm(X[None], W[None], precision=value),
             lambda: jb.dot_product_attention(q, q, q, precision=value),
             lambda: jb.lstm(jnp.ones((2, 3, 4)), jnp.ones((4, 8)), jnp.ones((2, 8)), jnp.zeros(8),
                             precision=value))
    for call in calls:
        with pytest.raises(ValueError, match=f"precision.*{message}|{message}.*precision|precision"):
            call()


def test_no_argument_follows_default_matmul_precision():
    with jax.default_matmul_precision("BF16_BF16_F32_X6"):
        assert precision.accuracy(None, "op") == "bf16_6x"
        np.testing.assert_allclose(jb.dense(X, W), jnp.dot(X, W, precision=P.HIGHEST), rtol=2e-6, atol=2e-6)
    with jax.default_matmul_precision("F16_F16_F32"):
        with pytest.raises(ValueError, match="jax.default_matmul_precision"):
            jb.dense(X, W)
    assert precision.accuracy(None, "op") == "float32"


def test_modules_and_accelerate_take_the_layers_precision():
    for value in (P.HIGH, "BF16_BF16_F32_X3", A.BF16_BF16_F32):
        layer = jb.nn.Dense(7, precision=value)
        params = layer.init(jax.random.key(0), X)
        assert "jb_fc_fwd" in jax.jit(layer.apply).lower(params, X).as_text()
        stock = nn.Dense(7, precision=value)
        with jb.accelerate(policy=False) as acc:
            y = stock.apply(params, X)
        assert [c.accelerated for c in acc.calls] == [True]
        np.testing.assert_allclose(y, stock.apply(params, X, rngs=None), rtol=2e-5, atol=2e-5)
    linear = nnx.Linear(33, 7, precision=P.HIGH, rngs=nnx.Rngs(0))
    with jb.accelerate(policy=False) as acc:
        linear(X)
    assert [c.accelerated for c in acc.calls] == [True]
    # an algorithm the kernels do not compute: the stock layer runs, and the report says why
    stock = nn.Dense(7, precision="F16_F16_F32")
    with jb.accelerate(policy=False) as acc:
        jax.eval_shape(stock.apply, params, X)
    assert not acc.calls[0].accelerated and "precision" in acc.calls[0].reason


TABLE_SCRIPT = """
import json, re
import jax, jax.numpy as jnp
import jax_brgemm as jb
from jax_brgemm import precision
def products(f, *shapes):
    hlo = jax.jit(f).lower(*(jnp.ones(s) for s in shapes)).as_text()
    return sorted({int(p) for p in re.findall(r"products = (\\d+)", hlo)})
print(json.dumps({"isa": jb.isa(), "multiplier": precision.multiplier(),
                  "computed": {f: {a: precision.computed(a, f) for a in precision.PRODUCTS}
                               for f in ("dense", "conv", "attention", "lstm")},
                  "dense": products(lambda x, w: jb.dense(x, w, precision="high"), (4, 8), (8, 4)),
                  "conv": products(lambda x, w: jb.conv2d(x, w, precision="high"), (1, 5, 5, 8), (3, 3, 8, 4)),
                  "dense_one": products(lambda x, w: jb.dense(x, w, precision="BF16_BF16_F32"), (4, 8), (8, 4))}))
"""


def _table_in(env):
    env = {k: v for k, v in os.environ.items() if k != "JAX_BRGEMM_EMULATE"} | env
    proc = subprocess.run([sys.executable, "-c", TABLE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


ISAS = ("amx", "avx512", "avx2", "generic")  # best first: JAX_BRGEMM_ISA can only lower it
HOST_ISAS = ISAS[ISAS.index(jb.isa()):]
# AVX-512 multiplies bfloat16 with vdpbf16ps by default on AMD's cores (twice their FMA
# rate), widened to float32 on Intel's (half the FMA rate).
AMD = "AuthenticAMD" in open("/proc/cpuinfo").read()


@pytest.mark.parametrize("forced", [{"JAX_BRGEMM_ISA": isa} for isa in HOST_ISAS] +
                         ([{"JAX_BRGEMM_ISA": "avx512", "JAX_BRGEMM_BF16": m} for m in ("dot", "fp32")]
                          if "avx512" in HOST_ISAS else []))
def test_the_default_follows_what_the_cpu_multiplies_bfloat16_with(forced):
    """Without JAX_BRGEMM_EMULATE, each ISA (forced) computes what EMULATED lists for its
    multiplier, and the kernels are asked for those products: bf16_3x's 3 on AMX only, one
    product wherever bfloat16 is multiplied as bfloat16."""
    got = _table_in(forced)
    assert got["isa"] == forced["JAX_BRGEMM_ISA"]
    avx512 = {"dot": "vdpbf16ps", "fp32": "float32"}.get(forced.get("JAX_BRGEMM_BF16"), "vdpbf16ps" if AMD else "float32")
    want_multiplier = {"amx": "amx", "avx512": avx512}
    assert got["multiplier"] == want_multiplier.get(got["isa"], "float32")
    table = precision.EMULATED[got["multiplier"]]
    assert got["computed"] == {f: {a: a if f in table.get(a, ()) else "float32" for a in precision.PRODUCTS}
                               for f in ("dense", "conv", "attention", "lstm")}
    for f in ("dense", "conv"):  # the kernels are asked for what computed() says (0: exact_on_infinity's branch)
        assert (3 in got[f]) == (f in table.get("bf16_3x", ())), (f, got[f])
    assert (1 in got["dense_one"]) == ("dense" in table.get("bf16", ())), got["dense_one"]
    assert (got["multiplier"] != "float32") == (got["computed"]["dense"]["bf16"] == "bf16")
    if got["multiplier"] == "amx":  # measured: bf16_3x convolutions slower than exact float32 there
        assert got["computed"]["dense"]["bf16_3x"] == "bf16_3x" and got["computed"]["conv"]["bf16_3x"] == "float32"


@pytest.mark.parametrize("switch,want", [("1", "bf16_3x"), ("0", "float32"), ("yes", None)])
def test_the_switch_overrides_the_default(switch, want):
    if want is None:
        env = {k: v for k, v in os.environ.items() if k != "JAX_BRGEMM_EMULATE"} | {"JAX_BRGEMM_EMULATE": switch}
        proc = subprocess.run([sys.executable, "-c", "import jax_brgemm"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode != 0 and "JAX_BRGEMM_EMULATE='yes'" in proc.stderr
        return
    got = _table_in({"JAX_BRGEMM_EMULATE": switch})
    for f in ("dense", "conv"):
        assert got["computed"][f]["bf16_3x"] == want and got["computed"][f]["float32"] == "float32"
