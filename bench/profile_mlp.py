"""Where the main job's training step spends its time: per-op wall time of the training
harness's own step for the ``mlp`` benchmark (its model, preprocessing, loss and optax
optimizer with the suite's hyperparameters, the state donated), for impl="brgemm" and
impl="xla", from a JAX profiler trace.

    python bench/profile_mlp.py [--n 256] [--dtype float32] [--steps 20]
    python bench/profile_mlp.py --parts [--rounds 10]   # forward / gradients / step split
    python bench/profile_mlp.py --timeline [--generic]  # where the cores' time goes

Each op of the compiled step (a custom call, an XLA fusion or dot) is named after the layer
it belongs to (from the HLO metadata) and its kind; the table gives ms per step, and the
totals split the step into layer work (forward, backward, weight update) and the rest
(loss and optimizer). For impl="brgemm" every layer pass is also timed alone, the same
way (the same custom call in a jitted function of its own, on operands of the same shapes,
called over and over), so the table shows what the step costs each pass beyond its own
work: cold operands and fresh output pages. Writes nothing; prints a table per
implementation.

--timeline shows where the cores' time goes in one training step, brgemm and xla: the CPU
time of every thread (from /proc, without the profiler) against the wall time, i.e. the idle
core time; and, for brgemm, from a trace with the workers' own timestamps (every worker's
stretch in a custom call, its re-blocking of weights and operands inside), how much of the
step has 0, 1 or 2 cores busy and how long XLA's own ops (the optimizer's element-wise
fusions, the loss) run while a custom call computes. With asynchronous custom calls a call
in the step is timed from its start to its completion event ("end: ..."), not the handler's
return.

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
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_brgemm as jb


def step_fn(impl, n, dtype, generic=False):
    """The training harness's own step for the ``mlp`` benchmark (its model, loss, optimizer
    with the suite's hyperparameters and preprocessing), jitted with the state donated as
    the harness does (with impl="brgemm" the step with SGD fused into the weight updates,
    as the harness picks it; the generic optax step after jax.grad with ``generic``), and its
    (state, batch) on random Fashion-MNIST-shaped images."""
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
    plan = fused.plan(bench, state, example, hp, steps) if impl == "brgemm" and not generic else None
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
    ops = op_intervals(events, labels)
    for name, start, end in ops:
        per_op[name] += (end - start) / 1e3 / steps  # us -> ms per call
    # The step: from its first op's start to its last op's end, per step.
    per_op["<step>"] = (max(e for _, s, e in ops) - min(s for _, s, e in ops)) / 1e3 / steps
    return per_op


def op_intervals(events, labels):
    """(name, start us, end us) of every op of ``labels`` in a trace: a custom call or a dot
    (asynchronous thunks: their work goes on after the thunk returned) lasts from its start
    to its completion event ("end: name"), any other op its own event."""
    xs = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    pending = collections.defaultdict(collections.deque)
    out = []
    for e in xs:
        name = e["name"]
        if name in labels:
            out.append([name, e["ts"], e["ts"] + e["dur"]])
            if labels[name].endswith(" dot") or " jb_" in labels[name]:
                pending[name].append(out[-1])
        elif name.startswith("end: ") and pending[name[5:]]:
            pending[name[5:]].popleft()[2] = e["ts"] + e["dur"]
    return [tuple(o) for o in out]


def profile(impl, n, dtype, steps):
    fn, jitted, args = step_fn(impl, n, dtype)
    labels = op_labels(jitted.lower(*args).compile().as_text())
    return traced_ms(fn, args, steps, labels, carry=True), labels


def thread_cpu_ns():
    """{tid: CPU ns} of every thread of this process (/proc/self/task/*/schedstat)."""
    out = {}
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                out[int(path.split("/")[-2])] = int(f.read().split()[0])
        except OSError:
            pass
    return out


def cpu_split(fn, args, steps):
    """(wall ms, {tid: CPU ms}) per step over ``steps`` untraced training steps."""
    for _ in range(3):
        args = jax.block_until_ready(fn(*args))
    before, t = thread_cpu_ns(), time.perf_counter()
    for _ in range(steps):
        args = jax.block_until_ready(fn(*args))
    wall, after = (time.perf_counter() - t) * 1e3 / steps, thread_cpu_ns()
    cpu = {tid: (ns - before.get(tid, 0)) / 1e6 / steps for tid, ns in after.items()}
    return wall, {tid: ms for tid, ms in cpu.items() if ms > 0.01 * wall}


def busy_profile(intervals, window):
    """{cores busy: us} over ``window`` (start, end) from (start, end) intervals."""
    edges = sorted([(a, 1) for a, b in intervals] + [(b, -1) for a, b in intervals])
    out, level, last = collections.Counter(), 0, window[0]
    for t, d in edges:
        t = min(max(t, window[0]), window[1])
        out[level] += t - last
        level, last = level + d, t
    out[level] += window[1] - last
    return out


def overlap_us(a, b):
    """Time both some interval of ``a`` and some of ``b`` are running (each a list)."""
    level = collections.Counter()
    edges = sorted([(s, "a", 1) for s, e in a] + [(e, "a", -1) for s, e in a]
                   + [(s, "b", 1) for s, e in b] + [(e, "b", -1) for s, e in b])
    total, last = 0.0, None
    for t, who, d in edges:
        if last is not None and level["a"] > 0 and level["b"] > 0:
            total += t - last
        level[who] += d
        last = t
    return total


def timeline(n, dtype, steps, generic=False):
    """Where the cores' time goes in the brgemm step (see the module doc), as printable lines."""
    from jax_brgemm import _jax_brgemm as native

    fn, jitted, args = step_fn("brgemm", n, dtype, generic)
    labels = op_labels(jitted.lower(*args).compile().as_text())
    for _ in range(3):
        args = jax.block_until_ready(fn(*args))
    native.timeline(True)
    native.timeline_take()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                args = jax.block_until_ready(fn(*args))
        spans = native.timeline_take()
        native.timeline(False)
        trace = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ops = op_intervals(events, labels)
    calls = [(s, e) for name, s, e in ops if "jb_" in labels[name]]
    # Our clock to the trace's: each call's first span on its calling thread starts when the
    # runtime's event for it does (the median offset of the pairs, in order).
    callers = sorted(sp[3] / 1e3 for sp in spans if sp[7])
    offsets = sorted(c[0] - r for c, r in zip(sorted(calls), callers))
    off = offsets[len(offsets) // 2] if offsets else 0.0
    workers = [(sp[3] / 1e3 + off, sp[3] / 1e3 + off + (sp[2] - sp[1]) / 1e3) for sp in spans]
    xla_ops = [(s, e) for name, s, e in ops if "jb_" not in labels[name]]
    elementwise = [(s, e) for name, s, e in ops if "jb_" not in labels[name] and "fusion" in labels[name]]
    window = (min(s for _, s, e in ops), max(e for _, s, e in ops))
    busy = busy_profile(workers + xla_ops, window)
    per = lambda us: us / 1e3 / steps
    lines = [f"  {'trace window per step':40s} {per(window[1] - window[0]):7.2f} ms",
             f"  {'custom-call workers, core time':40s} {per(sum(e - s for s, e in workers)):7.2f} ms"
             f"  (re-blocking {sum(sp[4] for sp in spans) / 1e6 / steps:.2f} ms)",
             f"  {'XLA ops (loss, optimizer), core time':40s} {per(sum(e - s for s, e in xla_ops)):7.2f} ms",
             f"  {'XLA element-wise fusions during a call':40s} {per(overlap_us(elementwise, workers)):7.2f} ms"
             f" of {per(sum(e - s for s, e in elementwise)):.2f} ms"]
    lines += [f"  {f'{k} cores busy':40s} {per(us):7.2f} ms" for k, us in sorted(busy.items())]
    by_job = collections.defaultdict(lambda: [0.0, 0.0])
    for sp in spans:
        by_job[sp[5]][0] += (sp[2] - sp[1]) / 1e6 / steps
        by_job[sp[5]][1] += sp[4] / 1e6 / steps
    solo = {} if generic else alone_core_ms(n, dtype, steps)
    lines.append(f"  {'workers, core time per step (re-blocking)':40s}" + ("  alone" if solo else ""))
    lines += [f"  {'  ' + job:40s} {ms:7.2f} ms  ({rb:.2f} ms)" + (f"  {solo[job]:6.2f} ms" if job in solo else "")
              for job, (ms, rb) in sorted(by_job.items())]
    return lines


def alone_core_ms(n, dtype, steps):
    """{job: workers' core ms} of every layer's passes of the fused step, each timed alone
    (alone_fns), summed over the layers: what the step's passes cost without the step."""
    from jax_brgemm import _jax_brgemm as native

    out = collections.Counter()
    for label, (fn, args) in alone_fns(n, dtype).items():
        carry = "sgd" in label
        for _ in range(3):
            out_args = jax.block_until_ready(fn(*args))
            args = out_args if carry else args
        native.timeline(True)
        native.timeline_take()
        for _ in range(steps):
            out_args = jax.block_until_ready(fn(*args))
            args = out_args if carry else args
        for sp in native.timeline_take():
            out[sp[5]] += (sp[2] - sp[1]) / 1e6 / steps
        native.timeline(False)
    return out


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
            jax.jit(lambda x, w, b, a=act: fc_passes.forward(x, w, b, a)), (x, w, b))
        fns[f"Dense_{i} jb_fc_upd_sgd"] = (jax.jit(
            lambda x, dz, w, m, b, mb: (x, dz, *sgd_update(
                x, dz, w, m, b, mb, 0.01, momentum=0.9, nesterov=True, weight_decay=0.0)),
            donate_argnums=(2, 3, 4, 5)), (x, dz, jnp.copy(w), jnp.zeros_like(w), jnp.copy(b), jnp.zeros_like(b)))
        if i > 0:  # the first layer's input needs no gradient
            fns[f"Dense_{i} jb_fc_bwd"] = (jax.jit(fc_passes.backward_data), (dz, w))
        if act == relu:
            fns[f"Dense_{i} jb_fc_act_grad"] = (
                jax.jit(lambda dy, y: fc_passes.activation_grad(dy, y, relu)),
                (dz, jax.nn.relu(dz)))
    return fns


def alone(n, dtype, steps):
    """{label: ms per call} of every BRGEMM pass timed alone."""
    out = {}
    for label, (fn, args) in alone_fns(n, dtype).items():
        labels = op_labels(fn.lower(*args).compile().as_text())
        per_op = traced_ms(fn, args, steps, labels, carry="sgd" in label)
        out[label] = sum(ms for name, ms in per_op.items() if name != "<step>")
    return out


def parts(n, dtype, rounds, ab_async=False):
    """ms per call (median over rounds) of loss, gradients, generic step and fused step;
    with ``ab_async`` brgemm's cases also with synchronous custom calls, in the same rounds."""
    from jax_brgemm import _jax_brgemm as native
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
        # the same step with optax.adamw instead of the suite's SGD
        adamw = step.create_state(bench, model, optax.adamw(1e-3), jax.random.key(0), example)
        cases[impl, "generic adamw"] = (jax.jit(functools.partial(step.train_step, bench=bench),
                                                 donate_argnums=0), adamw, True)
        plan = fused.plan(bench, state, example, hp, steps)
        if plan:  # the steps donate their state: each its own copy
            cases[impl, "fused step"] = (jax.jit(functools.partial(
                fused.train_step, bench=bench, plan=plan), donate_argnums=0),
                jax.tree.map(jnp.copy, state), True)

    if ab_async:  # brgemm's cases again, with synchronous custom calls
        for key in [k for k in cases if k[0] == "brgemm"]:
            fn, state, carry = cases[key]
            cases["brgemm sync", key[1]] = (fn, jax.tree.map(jnp.copy, state), carry)

    def run(key, reps):
        native.set_async(key[0] != "brgemm sync")
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
    native.set_async(True)
    return {key: (statistics.median(ts), min(ts), max(ts)) for key, ts in sorted(times.items())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--parts", action="store_true", help="the loss / gradients / step split")
    p.add_argument("--timeline", action="store_true", help="per-core time of one step")
    p.add_argument("--generic", action="store_true",
                   help="--timeline: brgemm's generic optax step (jb_fc_upd, then optax) instead of the fused one")
    p.add_argument("--rounds", type=int, default=10, help="--parts: interleaved rounds")
    p.add_argument("--ab-async", action="store_true", help="--parts: brgemm also with synchronous custom calls")
    args = p.parse_args(argv)
    jb.reuse_freed_memory()  # as the harness does
    dtype = None if args.dtype == "float32" else jnp.dtype(args.dtype)
    if args.timeline:
        print(f"N={args.n} {args.dtype}, per training step, {args.steps} steps, {jax.device_count()} device(s), "
              f"{len(os.sched_getaffinity(0))} cores")
        for impl in ("brgemm", "xla"):
            wall, cpu = cpu_split(*step_fn(impl, args.n, dtype, args.generic)[::2], max(args.steps, 50))
            cores = len(os.sched_getaffinity(0))
            print(f"impl={impl}: wall {wall:.2f} ms, CPU " + " + ".join(f"{ms:.2f}" for ms in sorted(cpu.values(), reverse=True))
                  + f" ms by thread; idle core time {cores * wall - sum(cpu.values()):.2f} ms of {cores * wall:.2f}")
        print(f"impl=brgemm, {'generic' if args.generic else 'fused'} step, from a trace (the workers' own timestamps):")
        print("\n".join(timeline(args.n, dtype, args.steps, args.generic)))
        return
    if args.parts:
        print(f"N={args.n} {args.dtype}, ms per call, median of {args.rounds} rounds (min-max)")
        for (impl, what), (med, lo, hi) in parts(args.n, dtype, args.rounds, args.ab_async).items():
            print(f"  {impl:11s} {what:18s} {med:7.2f}  ({lo:.2f}-{hi:.2f})")
        return
    for impl in ("brgemm", "xla"):
        per_op, labels = profile(impl, args.n, dtype, args.steps)
        step = per_op.pop("<step>", 0.0)
        print(f"\nimpl={impl}  N={args.n}  {args.dtype}: step {step:.2f} ms (traced, first op to last)."
              " An op's time runs from its start to its completion; ops that overlap add up to more")
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
