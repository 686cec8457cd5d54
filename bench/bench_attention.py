"""Attention benchmark: jb.dot_product_attention vs stock jax.nn.dot_product_attention (and
PyTorch's F.scaled_dot_product_attention when torch is installed), side by side in one process.

    python bench/bench_attention.py [--repeats 9] [--min-time 0.1] [--quick] [--dtypes float32,bfloat16]

Shapes (B, T, heads, head dim), self-attention (S = T): BERT-like (8, 128, 12, 64) and
(2, 512, 12, 64), ViT-like (16, 197, 6, 64) and (32, 64, 4, 32), and (4, 256, 8, 128); each
with and without causal masking, in float32 and bfloat16.

  fwd    the attention alone
  train  forward and the gradients of q, k and v (one jitted jax.grad; torch: forward and
         backward), the cotangent a fixed random array

GFLOP/s count the products of the attention: 4 B N T S H for the forward (two products),
three times that for training (four more in the backward), halved when causal (the
products past the diagonal do no work). jax_brgemm's backward recomputes the scores; that
is not counted. torch runs in its own layout (B, N, T, H); jax in (B, T, N, H).
Every contender is timed round-robin (common.interleaved); medians and min-max over
`repeats` samples; the machine's peak is measured by the probe in the same run.
Writes bench/results/<cpu>/attention.json and attention.png (training).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import common  # noqa: E402

import jax_brgemm as jb  # noqa: E402

SHAPES = ((8, 128, 12, 64), (2, 512, 12, 64), (16, 197, 6, 64), (32, 64, 4, 32), (4, 256, 8, 128))
QUICK = ((8, 128, 12, 64), (16, 197, 6, 64))
PASSES = ("fwd", "train")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def contenders(b, t, n, h, causal, dtype, torch):
    """{name: {pass: (fn, args)}} for one shape, masking and dtype."""
    rng = np.random.default_rng(b * t + n * h)
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, t, n, h)), dtype) for _ in range(4))
    out = {}
    for name, attention in (("jax_brgemm", jb.dot_product_attention), ("stock", jax.nn.dot_product_attention)):
        f = lambda q, k, v, attention=attention: attention(q, k, v, is_causal=causal)
        weighted = lambda q, k, v, f=f: jnp.sum((f(q, k, v) * do).astype(jnp.float32))
        out[name] = {"fwd": (jax.jit(f), (q, k, v)),
                     "train": (jax.jit(jax.grad(weighted, (0, 1, 2))), (q, k, v))}
    if torch is not None:
        tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        sdpa = torch.nn.functional.scaled_dot_product_attention
        # torch's own layout, (B, N, T, H), made once outside the timing
        tq, tk, tv, tdo = (torch.from_numpy(np.asarray(a, np.float32).transpose(0, 2, 1, 3).copy()).to(tdt)
                           for a in (q, k, v, do))
        gq, gk, gv = (a.clone().requires_grad_(True) for a in (tq, tk, tv))

        def t_fwd():
            with torch.no_grad():
                return sdpa(tq, tk, tv, is_causal=causal)

        def t_train():
            for a in (gq, gk, gv):
                a.grad = None
            sdpa(gq, gk, gv, is_causal=causal).backward(tdo)
            return gq.grad

        out["torch"] = {"fwd": (t_fwd, ()), "train": (t_train, ())}
    return out


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main(argv=None):
    p = common.arg_parser(__doc__, 9, 0.1)
    p.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args(argv)
    torch = common.torch_or_none()

    peak = common.measure_peak()
    print(f"measured peak: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s; "
          f"kernel ISA {jb.isa()}; torch {torch.__version__ if torch else 'not installed'}", flush=True)

    rows = []
    for dname in args.dtypes.split(","):
        for causal in (False, True):
            for b, t, n, h in (QUICK if args.quick else SHAPES):
                cont = contenders(b, t, n, h, causal, DTYPES[dname], torch)
                for pas in PASSES:
                    fns = {name: cont[name][pas][0] for name in cont}
                    fargs = {name: cont[name][pas][1] for name in cont}
                    samples = common.interleaved(fns, fargs, repeats=args.repeats, min_time=args.min_time)
                    flops = 4.0 * b * n * t * t * h * (3 if pas == "train" else 1) * (0.5 if causal else 1)
                    row = {"dtype": dname, "b": b, "t": t, "heads": n, "h": h, "causal": causal, "pass": pas,
                           "flops": flops, **common.summarize(samples, flops)}
                    med = {k: v["median"] for k, v in row["seconds"].items()}
                    row["peak_fraction"] = row["gflops"]["jax_brgemm"] / peak[dname]
                    row["vs_stock"] = med["stock"] / med["jax_brgemm"]
                    if "torch" in med:
                        row["vs_torch"] = med["torch"] / med["jax_brgemm"]
                    rows.append(row)
                    print(f"{dname:8s} {'causal' if causal else 'full  '} B={b:<3d} T={t:<4d} N={n:<3d} H={h:<4d} "
                          f"{pas:5s} " + "  ".join(f"{k} {row['gflops'][k]:6.1f}" for k in row["gflops"]) +
                          f"  | {100 * row['peak_fraction']:5.1f}% of peak, {row['vs_stock']:.2f}x stock" +
                          (f", {row['vs_torch']:.2f}x torch" if "vs_torch" in row else ""), flush=True)

    summary = {}
    for dname in args.dtypes.split(","):
        for pas in PASSES:
            sel = [r for r in rows if r["dtype"] == dname and r["pass"] == pas]
            summary[f"{dname} {pas}"] = {
                "vs_stock_geomean": geomean([r["vs_stock"] for r in sel]),
                "vs_stock_min": min(r["vs_stock"] for r in sel),
                "vs_torch_geomean": geomean([r["vs_torch"] for r in sel if "vs_torch" in r])}
    common.write_results("attention", {"peak_gflops": peak, "repeats": args.repeats, "min_time": args.min_time,
                                       "torch": torch.__version__ if torch else None, "rows": rows,
                                       "summary": summary})
    plots(rows, peak)
    print(markdown(rows, summary, peak))


def label(r):
    short = {"float32": "f32", "bfloat16": "bf16"}
    return f"{short[r['dtype']]}{' causal' if r['causal'] else ''} {r['b']}x{r['t']}x{r['heads']}x{r['h']}"


def plots(rows, peak):
    train = [r for r in rows if r["pass"] == "train"]
    names = list(train[0]["gflops"])
    common.plot_bars("attention", [label(r) for r in train], {n: [r["gflops"][n] for r in train] for n in names},
                     "GFLOP/s (median)", f"Attention training (fwd + grads of q, k, v), {jb.isa()}",
                     hline=peak["float32"], hline_label="fp32 peak (probe)")


def markdown(rows, summary, peak):
    names = list(rows[0]["gflops"])
    out = common.peak_table_head(peak, ["dtype", "causal", "B, T, heads, H", "pass"], names, "stock")
    for r in rows:
        lo_hi = {n: r["gflops_range"][n] for n in names}
        cells = [f"{r['gflops'][n]:.0f} ({lo_hi[n][0]:.0f}-{lo_hi[n][1]:.0f})" for n in names]
        shape = f"{r['b']}, {r['t']}, {r['heads']}, {r['h']}"
        out.append(f"| {r['dtype']} | {'yes' if r['causal'] else 'no'} | {shape} | {r['pass']} | " + " | ".join(cells) +
                   f" | {100 * r['peak_fraction']:.0f}% | {r['vs_stock']:.2f}x |" +
                   (f" {r['vs_torch']:.2f}x |" if "vs_torch" in r else ""))
    out += ["", "| dtype, pass | vs stock (geomean) | vs stock (min) | vs torch (geomean) |", "|---|---|---|---|"]
    for key, s in summary.items():
        out.append(f"| {key} | {s['vs_stock_geomean']:.2f}x | {s['vs_stock_min']:.2f}x | "
                   f"{s['vs_torch_geomean']:.2f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
