"""Attention benchmark: jb.dot_product_attention vs stock jax.nn.dot_product_attention (and
PyTorch's F.scaled_dot_product_attention when torch is installed), side by side in one process;
and a pre-LayerNorm Transformer encoder block's training step.

    python bench/bench_attention.py [--repeats 9] [--min-time 0.1] [--quick] [--dtypes float32,bfloat16]
                                    [--parts attention,block]

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
Encoder block (--parts block): one jax_brgemm.models.EncoderBlock (LN, self-attention, residual,
LN, MLP Dense-gelu-Dense, residual) trained for a step: forward and the gradients of the
parameters and the input. Contenders: impl="brgemm" (attention and projections on the
kernels, the gelu fused), impl="xla" (stock flax), and torch.nn.TransformerEncoderLayer
(norm_first=True, batch_first=True, dropout 0, gelu; forward and backward). Shapes (B, T,
width, heads, MLP width): BERT-base-like (8, 128, 768, 12, 3072) and ViT-S/16-like (16, 197,
384, 6, 1536); --quick takes a quarter-size one instead. GFLOP/s count the block's products:
2 B T (4 D^2 + 2 D F) for the projections and the MLP plus 4 B T^2 D for the attention, three
times that for training.

Every contender is timed round-robin (common.interleaved); medians and min-max over
`repeats` samples; the machine's peak is measured by the probe in the same run.
Writes bench/results/<cpu>/attention.json, attention.png (attention training) and
attention_block.png (the encoder block).
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
BLOCK_SHAPES = ((8, 128, 768, 12, 3072), (16, 197, 384, 6, 1536))  # (B, T, width, heads, MLP)
BLOCK_QUICK = ((2, 64, 192, 3, 768),)
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


def block_contenders(b, t, d, n, f, dtype, torch):
    """{name: (fn, args)}: one encoder block's training step (forward, gradients of the
    parameters and the input) for one shape and dtype."""
    from jax_brgemm.models import EncoderBlock, layers

    rng = np.random.default_rng(b * t + d)
    x, dy = (jnp.asarray(rng.standard_normal((b, t, d)), dtype) for _ in range(2))
    out, params = {}, None
    for name, impl in (("jax_brgemm", "brgemm"), ("stock", "xla")):
        chosen = layers(impl)
        # bfloat16: a bfloat16 computation on float32 parameters (torch's layer is all bfloat16)
        block = EncoderBlock(n, f, dense=chosen.dense, attention_cls=chosen.attention, dtype=dtype)
        if params is None:  # one set for both
            params = jax.jit(block.init)(jax.random.key(0), x)
        weighted = lambda p, x, block=block: jnp.sum((block.apply(p, x) * dy).astype(jnp.float32))
        out[name] = (jax.jit(jax.grad(weighted, (0, 1))), (params, x))
    if torch is not None:
        tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        layer = torch.nn.TransformerEncoderLayer(d, n, f, dropout=0.0, activation="gelu", batch_first=True,
                                                 norm_first=True).to(tdt)
        tx = torch.from_numpy(np.asarray(x, np.float32)).to(tdt).requires_grad_(True)
        tdy = torch.from_numpy(np.asarray(dy, np.float32)).to(tdt)

        def t_train():
            layer.zero_grad(set_to_none=True)
            tx.grad = None
            layer(tx).backward(tdy)
            return tx.grad

        out["torch"] = (t_train, ())
    return out


def finish_row(row, peak, what):
    """Adds the ratios and the fraction of the peak to a timed row, and prints it."""
    med = {k: v["median"] for k, v in row["seconds"].items()}
    row["peak_fraction"] = row["gflops"]["jax_brgemm"] / peak[row["dtype"]]
    row["vs_stock"] = med["stock"] / med["jax_brgemm"]
    if "torch" in med:
        row["vs_torch"] = med["torch"] / med["jax_brgemm"]
    print(f"{row['dtype']:8s} {what} " + "  ".join(f"{k} {row['gflops'][k]:6.1f}" for k in row["gflops"]) +
          f"  | {100 * row['peak_fraction']:5.1f}% of peak, {row['vs_stock']:.2f}x stock" +
          (f", {row['vs_torch']:.2f}x torch" if "vs_torch" in row else ""), flush=True)
    return row


def block_rows(args, torch, peak):
    """The encoder block's training-step rows, printed as they come."""
    rows = []
    for dname in args.dtypes.split(","):
        for b, t, d, n, f in (BLOCK_QUICK if args.quick else BLOCK_SHAPES):
            cont = block_contenders(b, t, d, n, f, DTYPES[dname], torch)
            samples = common.interleaved({k: v[0] for k, v in cont.items()}, {k: v[1] for k, v in cont.items()},
                                         repeats=args.repeats, min_time=args.min_time)
            flops = 3.0 * (2.0 * b * t * (4 * d * d + 2 * d * f) + 4.0 * b * t * t * d)
            row = {"dtype": dname, "b": b, "t": t, "width": d, "heads": n, "mlp": f, "pass": "train",
                   "flops": flops, **common.summarize(samples, flops)}
            rows.append(finish_row(row, peak, f"block B={b:<3d} T={t:<4d} D={d:<4d} N={n:<3d} F={f:<5d} train"))
    return rows


def summarize_rows(rows, dtypes, passes, prefix=""):
    summary = {}
    for dname in dtypes:
        for pas in passes:
            sel = [r for r in rows if r["dtype"] == dname and r["pass"] == pas]
            if sel:
                summary[f"{dname} {prefix}{pas}"] = {
                    "vs_stock_geomean": geomean([r["vs_stock"] for r in sel]),
                    "vs_stock_min": min(r["vs_stock"] for r in sel),
                    "vs_torch_geomean": geomean([r["vs_torch"] for r in sel if "vs_torch" in r])}
    return summary


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main(argv=None):
    p = common.arg_parser(__doc__, 9, 0.1)
    p.add_argument("--quick", action="store_true", help=f"only {QUICK}, and the block at {BLOCK_QUICK}")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--parts", default="attention,block", help="attention, block, or both (comma-separated)")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts or parts - {"attention", "block"}:
        p.error(f"--parts must name attention and / or block, got {args.parts!r}")
    torch = common.torch_or_none()

    peak = common.measure_peak()
    print(f"measured peak: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s; "
          f"kernel ISA {jb.isa()}; torch {torch.__version__ if torch else 'not installed'}", flush=True)

    rows = []
    for dname in args.dtypes.split(",") if "attention" in parts else ():
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
                    rows.append(finish_row(row, peak, f"{'causal' if causal else 'full  '} B={b:<3d} T={t:<4d} "
                                                      f"N={n:<3d} H={h:<4d} {pas:5s}"))
    blocks = block_rows(args, torch, peak) if "block" in parts else []

    dtypes = args.dtypes.split(",")
    summary = {**summarize_rows(rows, dtypes, PASSES), **summarize_rows(blocks, dtypes, ("train",), "block ")}
    common.write_results("attention", {"peak_gflops": peak, "repeats": args.repeats, "min_time": args.min_time,
                                       "torch": torch.__version__ if torch else None, "rows": rows,
                                       "block_rows": blocks, "summary": summary})
    plots(rows, blocks, peak)
    print(markdown(rows, blocks, summary, peak))


def label(r):
    short = {"float32": "f32", "bfloat16": "bf16"}
    return f"{short[r['dtype']]}{' causal' if r['causal'] else ''} {r['b']}x{r['t']}x{r['heads']}x{r['h']}"


def block_label(r):
    return f"{'f32' if r['dtype'] == 'float32' else 'bf16'} {r['b']}x{r['t']} D={r['width']} N={r['heads']}"


def plots(rows, blocks, peak):
    train = [r for r in rows if r["pass"] == "train"]
    for name, sel, lab, title in (
            ("attention", train, label, "Attention training (fwd + grads of q, k, v)"),
            ("attention_block", blocks, block_label, "Encoder block training step (fwd + grads)")):
        if sel:
            names = list(sel[0]["gflops"])
            common.plot_bars(name, [lab(r) for r in sel], {n: [r["gflops"][n] for r in sel] for n in names},
                             "GFLOP/s (median)", f"{title}, {jb.isa()}",
                             hline=peak["float32"], hline_label="fp32 peak (probe)")


def _cells(r, names):
    cells = [f"{r['gflops'][n]:.0f} ({r['gflops_range'][n][0]:.0f}-{r['gflops_range'][n][1]:.0f})" for n in names]
    return (" | ".join(cells) + f" | {100 * r['peak_fraction']:.0f}% | {r['vs_stock']:.2f}x |" +
            (f" {r['vs_torch']:.2f}x |" if "vs_torch" in r else ""))


def markdown(rows, blocks, summary, peak):
    out = []
    if rows:
        names = list(rows[0]["gflops"])
        out = common.peak_table_head(peak, ["dtype", "causal", "B, T, heads, H", "pass"], names, "stock")
        for r in rows:
            shape = f"{r['b']}, {r['t']}, {r['heads']}, {r['h']}"
            out.append(f"| {r['dtype']} | {'yes' if r['causal'] else 'no'} | {shape} | {r['pass']} | " + _cells(r, names))
    if blocks:
        names = list(blocks[0]["gflops"])
        head = common.peak_table_head(peak, ["dtype", "encoder block B, T, width, heads, MLP"], names, "stock")
        out += ([""] + head[2:]) if rows else head
        for r in blocks:
            shape = f"{r['b']}, {r['t']}, {r['width']}, {r['heads']}, {r['mlp']}"
            out.append(f"| {r['dtype']} | {shape} | " + _cells(r, names))
    out += ["", "| dtype, pass | vs stock (geomean) | vs stock (min) | vs torch (geomean) |", "|---|---|---|---|"]
    for key, s in summary.items():
        out.append(f"| {key} | {s['vs_stock_geomean']:.2f}x | {s['vs_stock_min']:.2f}x | "
                   f"{s['vs_torch_geomean']:.2f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
