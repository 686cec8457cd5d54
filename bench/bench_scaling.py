"""Scale-out on one machine: 1 process on 1 core against 2 processes on 1 core each.

    python bench/bench_scaling.py [--benchmarks mlp ...] [--batch 256] [--steps 20]
                                  [--repeats 5] [--impl brgemm] [--json OUT.json]
                                  [--bandwidth-gbit 10 25 100]

For every benchmark of the suite (train/suite.py), the harness's own train step
(step.train_step; under shard_map over the job's mesh for 2 processes, exactly as
``python -m jax_brgemm.train BENCHMARK --processes 2`` runs it) on synthetic batches:

* weak scaling: the same per-process batch B: 1 x B against 2 x B global;
* strong scaling: the same global batch B: 1 x B against 2 x B/2;
* the all-reduce of the step (its one all-reduce of the gradients as one vector, alone) and an
  all-reduce sweep over sizes: time per step against the bytes reduced.

Throughput is training examples per second of the whole job; efficiency is
throughput(2) / (2 x throughput(1)). Then, on paper, a projection to N hosts: step time
``T(N) = T_compute + 2 (N-1)/N * S / BW`` (ring all-reduce of S bytes of fp32 gradients,
no overlap of compute and communication), efficiency ``T_compute / T(N)``, and where it
falls below 90 %.

The workers are started with the harness's launcher (jax_brgemm.train.distributed.launch):
the same core shares, the same gloo collectives. Timings on a shared 2-core machine are
noisy: each figure is the median of --repeats loops of --steps steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SWEEP_FLOATS = [2 ** k for k in (12, 14, 16, 18, 20, 22)]


# --------------------------------------------------------------------------- worker


def _worker(argv):
    """One process of a measurement: prints nothing, process 0 writes --out."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--benchmark")
    p.add_argument("--impl")
    p.add_argument("--batch", type=int)  # global batch
    p.add_argument("--steps", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out")
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    a = p.parse_args(argv)

    from jax_brgemm.train import distributed

    if a.num_processes > 1:
        distributed.initialize(distributed.JobSpec(a.coordinator, a.num_processes,
                                                   a.process_id))
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jax_brgemm.train import optim, step
    from jax_brgemm.train.hparams import resolve
    from jax_brgemm.train.suite import SUITE

    bench = SUITE[a.benchmark]
    hp = resolve(bench, {"global_batch_size": a.batch}, "open")  # the reference optimizer
    model = bench.model(impl=a.impl, dtype=None)
    example = bench.pipeline.preprocess(
        jnp.asarray(bench.pipeline.synthetic_batch(bench.dataset, 1).inputs))
    tx = optim.make(hp, optim.steps_per_epoch(bench.train_size, a.batch))
    state = step.create_state(bench, model, tx, jax.random.key(0), example)
    topo = distributed.topology()
    spec = bench.dataset.files[bench.pipeline.splits["train"][0]]
    rng = np.random.default_rng(1 + (topo.process_index if topo else 0))
    rows = a.batch // (topo.num_processes if topo else 1)
    from jax_brgemm.train.data import Batch

    local = Batch(rng.integers(0, 255, (rows, *spec.shape[1:])).astype(spec.dtype),
                  rng.integers(0, 10, rows).astype(np.int32), np.ones(rows, np.float32))
    fn = functools.partial(step.train_step, bench=bench)
    if topo:
        state = topo.replicate(state)
        fn = topo.data_parallel(fn, (P(), P()))
        batch = topo.global_batch(local)
    else:
        batch = local
    train = jax.jit(fn, donate_argnums=0)
    grad_floats = sum(x.size for x in jax.tree.leaves(state.params))

    def timed(f, x, n):
        out = f(x)
        jax.block_until_ready(out)
        samples = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                out = f(x)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - t0) / n)
        return statistics.median(samples), samples

    # the train step (state threads through)
    holder = {"state": state}

    def one_step(_):
        holder["state"], loss = train(holder["state"], batch)
        return loss

    step_s, step_samples = timed(one_step, None, a.steps)
    result = {"benchmark": a.benchmark, "impl": a.impl, "processes": topo.num_processes
              if topo else 1, "global_batch": a.batch, "step_s": step_s,
              "step_samples": step_samples, "throughput": a.batch / step_s,
              "grad_floats": grad_floats, "grad_bytes": 4 * grad_floats}
    if topo:
        # the step's own all-reduce (step.all_reduce: the gradients as one vector), alone
        grads = topo.replicate(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                                            holder["state"].params))
        mean = jax.jit(jax.shard_map(lambda g: step.all_reduce(g, distributed.AXIS),
                                     mesh=topo.mesh, in_specs=P(), out_specs=P(),
                                     check_vma=False))
        result["allreduce_s"], _ = timed(mean, grads, a.steps)
        if a.sweep:
            sweep = []
            for n in SWEEP_FLOATS:
                x = topo.replicate(np.zeros(n, np.float32))
                seconds, _ = timed(mean, x, max(5, a.steps))
                sweep.append({"bytes": 4 * n, "allreduce_s": seconds})
            result["sweep"] = sweep
    if (topo.process_index if topo else 0) == 0:
        Path(a.out).write_text(json.dumps(result))


# --------------------------------------------------------------------------- driver


def measure(benchmark, impl, batch, processes, steps, repeats, sweep=False) -> dict:
    from jax_brgemm.train import distributed

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = ["--benchmark", benchmark, "--impl", impl, "--batch", str(batch), "--steps",
                str(steps), "--repeats", str(repeats), "--out", str(out)] + (
            ["--sweep"] if sweep else [])
        cores = sorted(os.sched_getaffinity(0))[:processes]  # one core per process
        code = distributed.launch(args, processes, cores=cores,
                                  command=[sys.executable, __file__, "--worker"])
        if code != 0:
            raise SystemExit(f"bench worker failed ({benchmark}, {processes} processes): "
                             f"exit {code}")
        return json.loads(out.read_text())


def ring_step(t_compute, grad_bytes, hosts, gbit):
    """Step time on ``hosts`` hosts: compute + ring all-reduce at ``gbit`` Gbit/s."""
    if hosts == 1:
        return t_compute
    return t_compute + 2 * (hosts - 1) / hosts * grad_bytes / (gbit * 1e9 / 8)


def projection(t_compute, grad_bytes, gbits, hosts=(1, 2, 4, 8, 16, 32, 64)):
    rows = []
    for gbit in gbits:
        eff = {n: t_compute / ring_step(t_compute, grad_bytes, n, gbit) for n in hosts}
        below = next((n for n in hosts if eff[n] < 0.9), None)
        rows.append({"gbit": gbit, "efficiency": eff, "below_90_from": below})
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return _worker(argv)
    from jax_brgemm.train.loop import cpu_model
    from jax_brgemm.train.suite import SUITE

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--benchmarks", nargs="+", default=sorted(SUITE))
    p.add_argument("--impl", default="brgemm", choices=("brgemm", "xla"))
    p.add_argument("--batch", type=int, default=None,
                   help="per-process batch of weak scaling and global batch of strong "
                        "scaling (default: the benchmark's reference global_batch_size)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bandwidth-gbit", type=float, nargs="+", default=[10, 25, 100])
    p.add_argument("--json")
    a = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores (1 process on 1 core against 2 processes on 1 each)")

    report = {"cpu_model": cpu_model(), "impl": a.impl, "benchmarks": []}
    print(f"CPU: {report['cpu_model']}; impl {a.impl}; medians of {a.repeats} x {a.steps} "
          f"steps")
    for name in a.benchmarks:
        batch = a.batch or SUITE[name].hparams["common"]["global_batch_size"]
        one = measure(name, a.impl, batch, 1, a.steps, a.repeats)
        weak = measure(name, a.impl, 2 * batch, 2, a.steps, a.repeats, sweep=True)
        strong = measure(name, a.impl, batch, 2, a.steps, a.repeats)
        r = {"benchmark": name, "batch": batch, "one": one, "weak": weak, "strong": strong,
             "weak_efficiency": weak["throughput"] / (2 * one["throughput"]),
             "strong_efficiency": strong["throughput"] / (2 * one["throughput"]),
             "projection": projection(one["step_s"], one["grad_bytes"], a.bandwidth_gbit)}
        report["benchmarks"].append(r)
        mb = one["grad_bytes"] / 2 ** 20
        print(f"\n{name}: {one['grad_floats']:,} parameters, {mb:.1f} MiB of fp32 gradients "
              f"all-reduced per step")
        print(f"  {'':28s} {'global batch':>12s} {'step ms':>9s} {'img/s':>9s} "
              f"{'efficiency':>10s} {'all-reduce ms':>13s}")
        print(f"  {'1 process x 1 core':28s} {batch:12d} {1e3 * one['step_s']:9.2f} "
              f"{one['throughput']:9.0f} {'':>10s} {'-':>13s}")
        for label, m, e in (("weak: 2 processes x 1 core", weak, r["weak_efficiency"]),
                            ("strong: 2 processes x 1 core", strong, r["strong_efficiency"])):
            print(f"  {label:28s} {m['global_batch']:12d} {1e3 * m['step_s']:9.2f} "
                  f"{m['throughput']:9.0f} {100 * e:9.1f}% {1e3 * m['allreduce_s']:13.2f}")
        print("  all-reduce (2 processes, gloo over localhost) against size:")
        for s in weak["sweep"]:
            print(f"    {s['bytes'] / 2 ** 20:8.3f} MiB  {1e3 * s['allreduce_s']:8.3f} ms  "
                  f"{s['bytes'] / s['allreduce_s'] / 1e9:6.2f} GB/s")
        print(f"  projection (ring all-reduce, no overlap; T_compute {1e3 * one['step_s']:.1f}"
              f" ms at batch {batch} per host):")
        for row in r["projection"]:
            effs = "  ".join(f"N={n}: {100 * e:5.1f}%" for n, e in row["efficiency"].items())
            print(f"    {row['gbit']:5.0f} Gbit/s  {effs}  -> below 90 % from N = "
                  f"{row['below_90_from'] or '>64'}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
