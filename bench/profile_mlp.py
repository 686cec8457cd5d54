"""Where the main job's training step spends its time: per-op wall time of the training
harness's own step for the ``mlp`` benchmark (its model, preprocessing, loss and optax
optimizer with the suite's hyperparameters, the state donated), for impl="brgemm" and
impl="xla", from a JAX profiler trace.

    python bench/profile_mlp.py [--n 256] [--dtype float32] [--steps 20]
    python bench/profile_mlp.py --parts [--rounds 10]   # forward / gradients / step split

Each op of the compiled step (a custom call, an XLA fusion or dot) is named after the layer
it belongs to (from the HLO metadata) and its kind; the table gives ms per step, and the
totals split the step into layer work (forward, backward, weight update) and the rest
(loss and optimizer). For impl="brgemm" every layer pass is also timed alone, the same
way (the same custom call in a jitted function of its own, on operands of the same shapes,
called over and over), so the table shows what the step costs each pass beyond its own
work: cold operands and fresh output pages. Writes nothing; prints a table per
implementation.

--parts times, without the profiler, in one process and interleaved (so the machine's drift
hits all alike), the loss alone, the loss and its gradients (``jax.grad``, no optimizer),
the generic train step (``step.train_step``, optax after the gradients) and, for brgemm,
the harness's fused step (``train/fused.py``): the differences give what the optimizer
step costs each way.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_brgemm as jb


def step_fn(impl, n, dtype):
    """The training harness's own step for the ``mlp`` benchmark (its model, loss, optimizer
    with the suite's hyperparameters and preprocessing), jitted with the state donated as
    the harness does (with impl="brgemm" the step with SGD fused into the weight updates,
    as the harness picks it), and its (state, batch) on random Fashion-MNIST-shaped images."""
    from jax_brgemm.train import fused, hparams, optim, step, suite

    bench = suite.SUITE["mlp"]
    hp = hparams.defaults(bench, bench.hparams["common"]["opt_name"])
    steps = optim.steps_per_epoch(bench.train_size, n)
    tx = optim.make(hp, steps)
    batch = bench.pipeline.synthetic_batch(bench.dataset, n)
    rng = np.random.default_rng(n)
    batch = batch._replace(inputs=rng.integers(0, 256, batch.inputs.shape, np.uint8),
                           labels=rng.integers(0, 10, n).astype(np.int32))
    example = bench.pipeline.preprocess(jnp.asarray(batch.inputs[:1]))
    state = step.create_state(bench, bench.model(impl=impl, dtype=dtype), tx,
                              jax.random.key(0), example)
    plan = fused.plan(bench, state, example, hp, steps) if impl == "brgemm" else None
    train = jax.jit(functools.partial(fused.train_step, bench=bench, plan=plan) if plan else
                    functools.partial(step.train_step, bench=bench), donate_argnums=0)
    batch = jax.tree.map(jnp.asarray, batch)
    return (lambda state, batch: (train(state, batch)[0], batch)), train, (state, batch)


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


def traced_ms(fn, args, steps, labels, carry=False):
    """ms per call of each op of ``labels`` (and "<step>", the executable) over ``steps``
    calls of ``fn`` under the profiler; with ``carry``, ``fn``'s output is its next input
    (a training step), else the same arguments are reused."""
    for _ in range(3):  # compile and warm up
        out = jax.block_until_ready(fn(*args))
        args = out if carry else args
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                out = jax.block_until_ready(fn(*args))
                args = out if carry else args
        trace = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    per_op = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in labels:
            per_op[e["name"]] += e["dur"] / 1e3 / steps  # us -> ms per call
        elif e.get("ph") == "X" and e.get("name") == "ThunkExecutor::Execute":
            per_op["<step>"] += e["dur"] / 1e3 / steps
    return per_op


def profile(impl, n, dtype, steps):
    fn, jitted, args = step_fn(impl, n, dtype)
    labels = op_labels(jitted.lower(*args).compile().as_text())
    return traced_ms(fn, args, steps, labels, carry=True), labels


def alone_fns(n, dtype):
    """{label: (jitted single pass, operands)} for every BRGEMM pass of the step's MLP,
    with the step's shapes: 'Dense_1 jb_fc_upd', ..."""
    from jax_brgemm.ops import fc_passes
    from jax_brgemm.ops.dense import sgd_update

    relu, none = fc_passes.ACTIVATION_CODES["relu"], fc_passes.NONE
    rng = np.random.default_rng(0)
    dt = dtype or jnp.float32
    arr = lambda *shape, dtype=dt: jnp.asarray(rng.standard_normal(shape), dtype)
    widths = (784, 1024, 1024, 1024, 10)
    fns = {}
    for i, (c, k) in enumerate(zip(widths[:-1], widths[1:])):
        act = relu if i < len(widths) - 2 else none
        x, w, b, dz = arr(n, c), arr(c, k, dtype=jnp.float32) / 32, arr(k, dtype=jnp.float32), arr(n, k)
        fns[f"Dense_{i} jb_fc_fwd"] = (
            jax.jit(lambda x, w, b, a=act: fc_passes.forward_call(x, w, b, a)), (x, w, b))
        fns[f"Dense_{i} jb_fc_upd_sgd"] = (jax.jit(
            lambda x, dz, w, m, b, mb: (x, dz, *sgd_update(
                x, dz, w, m, b, mb, 0.01, momentum=0.9, nesterov=True, weight_decay=0.0)),
            donate_argnums=(2, 3, 4, 5)), (x, dz, jnp.copy(w), jnp.zeros_like(w), jnp.copy(b), jnp.zeros_like(b)))
        if i > 0:  # the first layer's input needs no gradient
            fns[f"Dense_{i} jb_fc_bwd"] = (jax.jit(fc_passes.backward_data_call), (dz, w))
        if act == relu:
            fns[f"Dense_{i} jb_fc_act_grad"] = (
                jax.jit(lambda dy, y: fc_passes.activation_grad_call(dy, y, relu)),
                (dz, jax.nn.relu(dz)))
    return fns


def alone(n, dtype, steps):
    """{label: ms per call} of every BRGEMM pass timed alone."""
    out = {}
    for label, (fn, args) in alone_fns(n, dtype).items():
        labels = set(op_labels(fn.lower(*args).compile().as_text()))
        per_op = traced_ms(fn, args, steps, labels, carry="sgd" in label)
        out[label] = sum(ms for name, ms in per_op.items() if name != "<step>")
    return out


def parts(n, dtype, rounds):
    """ms per call (median over rounds) of loss, gradients, generic step and fused step."""
    from jax_brgemm.train import fused, hparams, optim, step, suite

    bench = suite.SUITE["mlp"]
    hp = hparams.defaults(bench, "sgd")
    steps = optim.steps_per_epoch(bench.train_size, n)
    _, _, (_, batch) = step_fn("xla", n, dtype)
    example = bench.pipeline.preprocess(batch.inputs[:1])
    cases = {}
    for impl in ("brgemm", "xla"):
        model = bench.model(impl=impl, dtype=dtype)
        state = step.create_state(bench, model, optim.make(hp, steps), jax.random.key(0), example)

        def loss(params, batch, model=model):
            out = model.apply({"params": params}, bench.pipeline.preprocess(batch.inputs))
            return jnp.mean(bench.loss(out, batch.labels))

        cases[impl, "loss"] = (jax.jit(loss), state, False)
        cases[impl, "loss + gradients"] = (jax.jit(jax.grad(loss)), state, False)
        cases[impl, "generic step"] = (jax.jit(functools.partial(step.train_step, bench=bench),
                                                donate_argnums=0), jax.tree.map(jnp.copy, state), True)
        plan = fused.plan(bench, state, example, hp, steps)
        if plan:  # the steps donate their state: each its own copy
            cases[impl, "fused step"] = (jax.jit(functools.partial(
                fused.train_step, bench=bench, plan=plan), donate_argnums=0),
                jax.tree.map(jnp.copy, state), True)

    def run(key, reps):
        fn, state, carry = cases[key]
        out = None
        for _ in range(reps):
            out = fn(state, batch)[0] if carry else fn(state.params, batch)
            state = out if carry else state
        jax.block_until_ready(out)
        cases[key] = (fn, state, carry)

    for key in cases:
        run(key, 3)
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for key in cases:
            t = time.perf_counter()
            run(key, 10)
            times[key].append((time.perf_counter() - t) / 10 * 1e3)
    return {key: (statistics.median(ts), min(ts), max(ts)) for key, ts in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--parts", action="store_true", help="the loss / gradients / step split")
    p.add_argument("--rounds", type=int, default=10, help="--parts: interleaved rounds")
    args = p.parse_args(argv)
    jb.reuse_freed_memory()  # as the harness does
    dtype = None if args.dtype == "float32" else jnp.dtype(args.dtype)
    if args.parts:
        print(f"N={args.n} {args.dtype}, ms per call, median of {args.rounds} rounds (min-max)")
        for (impl, what), (med, lo, hi) in parts(args.n, dtype, args.rounds).items():
            print(f"  {impl:7s} {what:18s} {med:7.2f}  ({lo:.2f}-{hi:.2f})")
        return
    for impl in ("brgemm", "xla"):
        per_op, labels = profile(impl, args.n, dtype, args.steps)
        step = per_op.pop("<step>", 0.0)
        print(f"\nimpl={impl}  N={args.n}  {args.dtype}: step {step:.2f} ms (wall time of the executable)")
        by_label = collections.Counter()
        for name, ms in per_op.items():
            by_label[labels[name]] += ms
        solo = alone(args.n, dtype, args.steps) if impl == "brgemm" else {}
        if solo:
            print(f"  {'op':32s} {'in step':>9s} {'alone':>9s} {'step/alone':>10s}")
        for label, ms in sorted(by_label.items()):
            extra = f" {solo[label]:6.3f} ms {ms / solo[label]:9.2f}x" if label in solo else ""
            print(f"  {label:32s} {ms:6.3f} ms{extra}")
        layers = sum(ms for label, ms in by_label.items() if label.startswith("Dense_"))
        print(f"  {'layers (fwd, bwd, upd)':32s} {layers:6.3f} ms"
              + (f" {sum(solo.values()):6.3f} ms" if solo else ""))
        print(f"  {'loss and optimizer':32s} {sum(by_label.values()) - layers:6.3f} ms")


if __name__ == "__main__":
    main()
