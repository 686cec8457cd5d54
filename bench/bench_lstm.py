"""LSTM benchmark (the paper's Figure 6, scaled to this machine): jb.nn.LSTM vs stock Flax
nn.RNN(nn.OptimizedLSTMCell) (and PyTorch nn.LSTM when torch is installed), side by side
in one process.

    python bench/bench_lstm.py [--repeats 7] [--min-time 0.2] [--quick] [--n 64 168]
                               [--c 256 512 1024] [--dtypes float32 bfloat16]
                               [--passes fwd train] [--name lstm]

Shapes: T = 50, C = K in {256, 512, 1024}, N in {64, 168}; fp32 and bf16 (bf16 compute with
fp32 parameters, Flax's dtype=bfloat16; torch: the module in bfloat16).

  fwd    the whole sequence forward (the module's apply)
  train  fwd + bwd + upd: one jitted jax.grad of sum(y * dy) w.r.t. the parameters and x

GFLOP/s count 2 T N (C + K) 4K per forward (3x that for train); the fraction of peak is
against the machine's peak measured by the probe in the same run (fp32 FMA; bf16: the best
bf16 path, see jax_brgemm.peak_gflops). Breakdown (like the paper's Table 1, an estimate
from public functions only): "gemm" is the time jb.dense takes for the same multiply work as
one pass ((T N) x (C + K) x 4K, bias fused), the rest of the forward (element-wise cell math,
re-blocking, the per-step barriers) is "other". Every round takes one sample of each
contender, back to back; besides the ratio of the medians, each row has the median (and
range) of the rounds' own ratios, which machine noise lasting seconds disturbs least.
Writes bench/results/<cpu-kind>/<name>.json and .png.
"""

from __future__ import annotations


import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np

import common  # noqa: E402

import jax_brgemm as jb  # noqa: E402

T = 50
WIDTHS = (256, 512, 1024)
BATCHES = (64, 168)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}



def contenders(n, c, dtype, torch):
    k = c
    x = jax.random.normal(jax.random.key(0), (n, T, c), jnp.float32).astype(dtype)
    dy = jax.random.normal(jax.random.key(1), (n, T, k), jnp.float32)
    stock = fnn.RNN(fnn.OptimizedLSTMCell(k, dtype=dtype))
    ours = jb.nn.LSTM(k, dtype=dtype)
    params = stock.init(jax.random.key(2), x)
    out = {}
    for name, m in (("jax_brgemm", ours), ("flax", stock)):
        fwd = jax.jit(m.apply)
        train = jax.jit(jax.grad(lambda p, x, dy, m=m: jnp.sum(m.apply(p, x).astype(jnp.float32) * dy),
                                 argnums=(0, 1)))
        out[name] = {"fwd": (fwd, (params, x)), "train": (train, (params, x, dy))}
    if torch is not None:
        tdt = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32
        lstm = torch.nn.LSTM(c, k, batch_first=True).to(tdt)
        tx = torch.from_numpy(np.array(x, np.float32)).to(tdt)
        tdy = torch.from_numpy(np.array(dy)).to(tdt)
        txg = tx.clone().requires_grad_(True)

        def t_fwd():
            with torch.no_grad():
                return lstm(tx)[0]

        def t_train():
            lstm.zero_grad(set_to_none=True)
            txg.grad = None
            lstm(txg)[0].backward(tdy)
            return txg.grad

        out["torch"] = {"fwd": (t_fwd, ()), "train": (t_train, ())}
    # The GEMM-only reference for the breakdown: one pass's multiply work as one jb.dense.
    a = jnp.ones((n * T, 2 * c), dtype)
    w = jnp.ones((2 * c, 4 * k), jnp.float32) * 0.01
    b = jnp.zeros((4 * k,), jnp.float32)
    gemm = (jax.jit(lambda a, w, b: jb.dense(a, w, b, dtype=dtype)), (a, w, b))
    return out, gemm


def main(argv=None):
    p = common.arg_parser(__doc__, 7, 0.2)
    p.add_argument("--quick", action="store_true", help="C=K=512, N=168 only, fewer repeats")
    p.add_argument("--n", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--c", type=int, nargs="+", default=list(WIDTHS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--passes", nargs="+", default=["fwd", "train"], choices=["fwd", "train"])
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--name", default="lstm", help="results file name (bench/results/<cpu-kind>/NAME.json, .png)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.c, args.repeats = [168], [512], min(args.repeats, 3)
    torch = None if args.no_torch else common.torch_or_none()

    peak = common.measure_peak()
    print(f"measured peak: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s; "
          f"kernel ISA {jb.isa()}; torch {'yes' if torch else 'not installed'}; "
          f"cpu {common.machine().get('cpu', '?')}", flush=True)

    rows = []
    for dname in args.dtypes:
        for c in args.c:
            for n in args.n:
                cont, gemm = contenders(n, c, DTYPES[dname], torch)
                fwd_flops = 2.0 * T * n * (2 * c) * 4 * c
                for pas in args.passes:
                    fns = {name: cont[name][pas][0] for name in cont}
                    fargs = {name: cont[name][pas][1] for name in cont}
                    if pas == "fwd":
                        fns["gemm_only"], fargs["gemm_only"] = gemm
                    samples = common.interleaved(fns, fargs, repeats=args.repeats, min_time=args.min_time)
                    flops = fwd_flops * (3 if pas == "train" else 1)
                    row = {"dtype": dname, "t": T, "n": n, "c": c, "k": c, "pass": pas, "flops": flops,
                           **common.summarize(samples, flops)}
                    g = row["gflops"]
                    row["peak_fraction"] = g["jax_brgemm"] / peak[dname]
                    row["peak_fraction_fp32"] = g["jax_brgemm"] / peak["float32"]
                    row["vs_flax"] = g["jax_brgemm"] / g["flax"]
                    if "torch" in g:
                        row["vs_torch"] = g["jax_brgemm"] / g["torch"]
                    ours = samples["jax_brgemm"]
                    row["round_ratios"] = {f"vs_{k}": common.stats([o / m for o, m in zip(samples[k], ours)])
                                           for k in ("flax", "torch") if k in samples}
                    if pas == "fwd":
                        t_all = row["seconds"]["jax_brgemm"]["median"]
                        t_gemm = min(t_all, row["seconds"]["gemm_only"]["median"])
                        row["breakdown_fwd"] = {"gemm": t_gemm / t_all, "other": 1 - t_gemm / t_all}
                    rows.append(row)
                    print(f"{dname:8s} T={T} N={n:<4d} C=K={c:<5d} {pas:5s} " + "  ".join(
                        f"{k} {v:7.1f}" for k, v in g.items()) +
                        f"  | {100 * row['peak_fraction']:5.1f}% of peak, {row['vs_flax']:.2f}x flax" +
                        (f", {row['vs_torch']:.2f}x torch" if "vs_torch" in row else "") +
                        "; round by round " + ", ".join(f"{k} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"
                                                        for k, v in row["round_ratios"].items()), flush=True)

    common.write_results(args.name, {"peak_gflops": peak, "repeats": args.repeats, "min_time": args.min_time,
                                  "torch": bool(torch), "rows": rows})
    plot(args.name, rows, peak)
    print(markdown(rows))


def plot(name, rows, peak):
    short = {"float32": "f32", "bfloat16": "bf16"}
    names = [k for k in rows[0]["gflops"] if k != "gemm_only"]
    labels = [f"{short[r['dtype']]} N{r['n']} C{r['c']} {r['pass']}" for r in rows]
    common.plot_bars(name, labels, {k: [r["gflops"].get(k, 0.0) for r in rows] for k in names},
                     "GFLOP/s (median)", f"LSTM T={T}, C=K: forward and training step, {jb.isa()}",
                     hline=peak["float32"], hline_label="fp32 peak (probe)")


def markdown(rows):
    names = [k for k in rows[0]["gflops"] if k != "gemm_only"]
    out = ["| dtype | N | C=K | pass | " + " | ".join(f"{k} GFLOP/s" for k in names) +
           " | % of peak | vs flax | vs torch |", "|" + "---|" * (len(names) + 7)]
    for r in rows:
        out.append(f"| {r['dtype']} | {r['n']} | {r['c']} | {r['pass']} | " +
                   " | ".join(f"{r['gflops'].get(k, float('nan')):.0f}" for k in names) +
                   f" | {100 * r['peak_fraction']:.0f} % | {r['vs_flax']:.2f}x | "
                   f"{r['vs_torch']:.2f}x |" if "vs_torch" in r else
                   f"| {r['dtype']} | {r['n']} | {r['c']} | {r['pass']} | " +
                   " | ".join(f"{r['gflops'].get(k, float('nan')):.0f}" for k in names) +
                   f" | {100 * r['peak_fraction']:.0f} % | {r['vs_flax']:.2f}x | - |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
