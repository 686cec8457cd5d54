"""A small, version-stable set of timings: BRGEMM calls, an FC layer training step and an
MLP training step, fp32 and bf16, through the public API only (jb.brgemm, jb.dense,
models.MLP), so that two builds of jax_brgemm can be compared side by side.

    python bench/bench_steps.py [--repeats 7] [--json OUT.json]

Prints one line per case (median ms and min-max over the repeats) and, with --json, writes
them. To compare two builds, run this script alternately with each build's Python (A B A B
...) and compare the medians: the noise of a shared machine then hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_brgemm as jb
from jax_brgemm import models

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def seconds(fn, args, repeats, min_time=0.1):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = max(1, int(min_time / max(time.perf_counter() - t0, 1e-7)))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) / inner)
    return out


def cases(dtype):
    rng = np.random.default_rng(0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    a, b = normal(16, 96, 256).astype(dtype), normal(16, 256, 128).astype(dtype)
    yield "brgemm B16 96x256x128", jax.jit(jb.brgemm), (a, b)

    x, w, bias, dy = normal(256, 1024).astype(dtype), normal(1024, 1024) / 32, normal(1024), normal(256, 1024)
    layer = lambda x, w, b: jnp.sum((jb.dense(x, w, b, activation="relu", dtype=dtype) * dy).astype(jnp.float32))
    yield "FC step N256 C=K=1024 relu", jax.jit(jax.grad(layer, (0, 1, 2))), (x, w, bias)

    model = models.MLP(features=(1024, 1024, 1024), num_classes=10, activation="relu", impl="brgemm",
                       dtype=None if dtype == jnp.float32 else dtype)
    images, labels = normal(256, 784), jnp.asarray(rng.integers(0, 10, 256))
    params = model.init(jax.random.key(0), images)
    opt = optax.sgd(0.05, momentum=0.9, nesterov=True)

    def step(p, s):
        def loss(p):
            logits = model.apply(p, images).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        updates, s = opt.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    yield "MLP step N256 784-1024x3-10", jax.jit(step), (params, opt.init(params))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    rows = []
    for dname, dtype in DTYPES.items():
        for name, fn, fargs in cases(dtype):
            s = seconds(fn, fargs, args.repeats)
            rows.append({"case": name, "dtype": dname, "median_ms": 1e3 * statistics.median(s),
                         "min_ms": 1e3 * min(s), "max_ms": 1e3 * max(s)})
            r = rows[-1]
            print(f"{dname:8s} {name:30s} {r['median_ms']:8.3f} ms ({r['min_ms']:.3f}-{r['max_ms']:.3f})",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": jb.isa(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
