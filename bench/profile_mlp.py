"""Where an MLP training step spends its time: per-op wall time of one jitted step (the
bench_fc MLP step: softmax cross-entropy, jax.grad, optax SGD with momentum), for
models.MLP impl="brgemm" and impl="xla", from a JAX profiler trace.

    python bench/profile_mlp.py [--n 256] [--dtype float32] [--steps 20]

Each op of the compiled step (a custom call, an XLA fusion or dot) is named after the layer
it belongs to (from the HLO metadata) and its kind; the table gives ms per step, and the
totals split the step into layer work (forward, backward, weight update) and the rest
(loss and optimizer). Writes nothing; prints a table per implementation.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_brgemm import models


def step_fn(impl, n, dtype):
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.uniform(0, 1, (n, 28, 28)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, n))
    model = models.MLP(features=(1024, 1024, 1024), num_classes=10, activation="relu",
                       impl=impl, dtype=dtype)
    params = model.init(jax.random.key(0), x)
    opt = optax.sgd(0.01, momentum=0.9)

    def loss(p):
        logits = model.apply(p, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(p, s):
        updates, s = opt.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    return jax.jit(step), (params, opt.init(params))


def op_labels(compiled_text):
    """{instruction name: label} for the ops a CPU trace shows: 'Dense_2 jb_fc_upd',
    'Dense_1 dot', 'optimizer/loss fusion', ..."""
    labels = {}
    for line in compiled_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = .*?\b(custom-call|fusion|dot)\(", line)
        if not m:
            continue
        name, kind = m.groups()
        target = re.search(r'custom_call_target="(\w+)"', line)
        layer = re.search(r'op_name="[^"]*?(Dense_\d+)', line)
        what = target.group(1) if target else kind
        labels[name] = f"{layer.group(1)} {what}" if layer else f"loss/optimizer {what}"
    return labels


def profile(impl, n, dtype, steps):
    fn, args = step_fn(impl, n, dtype)
    labels = op_labels(fn.lower(*args).compile().as_text())
    for _ in range(3):  # compile and warm up
        args = jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                args = jax.block_until_ready(fn(*args))
        trace = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    per_op = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in labels:
            per_op[e["name"]] += e["dur"] / 1e3 / steps  # us -> ms per step
        elif e.get("ph") == "X" and e.get("name") == "ThunkExecutor::Execute":
            per_op["<step>"] += e["dur"] / 1e3 / steps
    return per_op, labels


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    for impl in ("brgemm", "xla"):
        per_op, labels = profile(impl, args.n, jnp.dtype(args.dtype), args.steps)
        step = per_op.pop("<step>", 0.0)
        print(f"\nimpl={impl}  N={args.n}  {args.dtype}: step {step:.2f} ms (wall time of the executable)")
        by_label = collections.Counter()
        for name, ms in per_op.items():
            by_label[labels[name]] += ms
        for label, ms in sorted(by_label.items()):
            print(f"  {label:32s} {ms:7.3f} ms")
        layers = sum(ms for label, ms in by_label.items() if label.startswith("Dense_"))
        print(f"  {'layers (fwd, bwd, upd)':32s} {layers:7.3f} ms")
        print(f"  {'loss and optimizer':32s} {sum(by_label.values()) - layers:7.3f} ms")


if __name__ == "__main__":
    main()
