"""BRGEMM kernel benchmark: jb.brgemm vs stock XLA (jnp.einsum), and PyTorch when installed.

    python bench/bench_brgemm.py [--repeats 15] [--calls 8]

Each jitted function holds `calls` independent BRGEMMs on distinct operands, as a training
step would, so Python dispatch is amortized. Contenders are timed round-robin in one
process; the table reports medians (min-max) and the fraction of the machine's peak
measured by the probe in the same run. Writes bench/results/<cpu-kind>/brgemm.{json,png}.
"""

from __future__ import annotations

import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import common  # noqa: E402

import jax_brgemm as jb  # noqa: E402

SHAPES = [(32, 64, 64, 64), (16, 32, 128, 64), (64, 48, 64, 96), (8, 256, 256, 256)]
SMALL = SHAPES[:3]  # the "three small shapes together" aggregate


def contenders(dtype, calls):
    def many(fn):
        return jax.jit(lambda As, Bs: [fn(a, b) for a, b in zip(As, Bs)])

    fns = {
        "jax_brgemm": many(jb.brgemm),
        "xla_einsum": many(lambda a, b: jnp.einsum("...bmk,...bkn->...mn", a, b,
                                                  preferred_element_type=jnp.float32)),
    }
    try:
        import torch

        tdtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        torch.set_num_threads(os.cpu_count() or 1)

        def torch_fn(As, Bs):
            with torch.no_grad():
                return [torch.einsum("bmk,bkn->mn", a, b).float() for a, b in zip(As, Bs)]

        fns["torch_einsum"] = (torch_fn, tdtype)
    except ImportError:
        pass
    return fns


def operands(shape, dtype, calls, seed):
    B, M, K, N = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * calls)
    As = [jax.random.normal(keys[2 * i], (B, M, K), jnp.float32).astype(dtype) for i in range(calls)]
    Bs = [jax.random.normal(keys[2 * i + 1], (B, K, N), jnp.float32).astype(dtype) for i in range(calls)]
    return As, Bs


def main(argv=None):
    p = common.arg_parser(__doc__, 15, 0.05)
    p.add_argument("--calls", type=int, default=8)
    args = p.parse_args(argv)

    peak = common.measure_peak()
    print(f"measured peak: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s "
          f"(kernel ISA {jb.isa()})")
    rows = []
    for dtype_name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        for shape in SHAPES:
            As, Bs = operands(shape, dtype, args.calls, seed=sum(shape))
            fns, fargs = {}, {}
            for name, fn in contenders(dtype, args.calls).items():
                if isinstance(fn, tuple):  # torch: its own tensors, same values
                    import torch
                    torch_fn, tdtype = fn
                    tA = [torch.from_numpy(np.array(a.astype(jnp.float32))).to(tdtype) for a in As]
                    tB = [torch.from_numpy(np.array(b.astype(jnp.float32))).to(tdtype) for b in Bs]
                    fns[name], fargs[name] = torch_fn, (tA, tB)
                else:
                    fns[name], fargs[name] = fn, (As, Bs)
            samples = common.interleaved(fns, fargs, repeats=args.repeats, min_time=args.min_time)
            B, M, K, N = shape
            flops = 2.0 * B * M * K * N * args.calls
            row = {"dtype": dtype_name, "shape": list(shape), "flops_per_call": flops,
                   "seconds": {k: common.stats(v) for k, v in samples.items()},
                   "gflops": {k: flops / statistics.median(v) / 1e9 for k, v in samples.items()},
                   "gflops_range": {k: [flops / max(v) / 1e9, flops / min(v) / 1e9] for k, v in samples.items()}}
            row["peak_fraction"] = row["gflops"]["jax_brgemm"] / peak[dtype_name]
            row["speedup_vs_xla"] = row["gflops"]["jax_brgemm"] / row["gflops"]["xla_einsum"]
            rows.append(row)
            print(f"{dtype_name:8s} {str(tuple(shape)):22s} " + "  ".join(
                f"{k} {row['gflops'][k]:6.1f}" for k in row["gflops"]) +
                f"  | {100 * row['peak_fraction']:5.1f}% of peak, {row['speedup_vs_xla']:.2f}x XLA")

    summary = {}
    for dtype_name in ("float32", "bfloat16"):
        small = [r for r in rows if r["dtype"] == dtype_name and tuple(r["shape"]) in SMALL]
        flops = sum(r["flops_per_call"] for r in small)
        t = {k: sum(r["seconds"][k]["median"] for r in small) for k in small[0]["seconds"]}
        summary[dtype_name] = {
            "small_shapes_gflops": {k: flops / v / 1e9 for k, v in t.items()},
            "small_shapes_peak_fraction": flops / t["jax_brgemm"] / 1e9 / peak[dtype_name],
            "small_shapes_speedup_vs_xla": t["xla_einsum"] / t["jax_brgemm"],
        }
        s = summary[dtype_name]
        print(f"{dtype_name}: three small shapes together: {s['small_shapes_gflops']['jax_brgemm']:.1f} GFLOP/s, "
              f"{100 * s['small_shapes_peak_fraction']:.1f}% of peak, {s['small_shapes_speedup_vs_xla']:.2f}x XLA")

    common.write_results("brgemm", {"peak_gflops": peak, "calls_per_jit": args.calls,
                                    "repeats": args.repeats, "rows": rows, "summary": summary})
    labels = [f"{r['dtype'][:4]} {'x'.join(map(str, r['shape']))}" for r in rows]
    names = list(rows[0]["gflops"])
    common.plot_bars("brgemm", labels, {n: [r["gflops"][n] for r in rows] for n in names},
                     "GFLOP/s (median)", f"BRGEMM, {jb.isa()}, 2 threads",
                     hline=peak["float32"], hline_label="fp32 peak (probe)")
    print(markdown(rows, peak))


def markdown(rows, peak):
    names = list(rows[0]["gflops"])
    head = "| dtype | B, M, K, N | " + " | ".join(f"{n} GFLOP/s" for n in names) + " | % of peak | vs XLA |"
    lines = [head, "|" + "---|" * (len(names) + 4)]
    for r in rows:
        cells = [f"{r['gflops'][n]:.0f} ({r['gflops_range'][n][0]:.0f}-{r['gflops_range'][n][1]:.0f})" for n in names]
        lines.append(f"| {r['dtype']} | {', '.join(map(str, r['shape']))} | " + " | ".join(cells) +
                     f" | {100 * r['peak_fraction']:.0f}% | {r['speedup_vs_xla']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
