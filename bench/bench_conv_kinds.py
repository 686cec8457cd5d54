"""The convolution kinds beyond the plain one (issue 47's table): depthwise, grouped, dilated
and transposed layers, one training step each (forward + input and weight gradients), jb.conv2d
vs stock XLA (lax.conv_general_dilated, what flax.linen.Conv / ConvTranspose run) vs PyTorch CPU
(channels-last, when torch is importable), round-robin in one process.

    python bench/bench_conv_kinds.py [--scale 4] [--repeats 3] [--dtypes float32,bfloat16]
                                     [--layers dw3,dw7,resnext,dilated,transposed] [--passes]
                                     [--only jax_brgemm,torch]

--scale divides each layer's mini-batch (stock XLA takes seconds per step on some of them).
GFLOP/s count 2 N P Q K (C / G) R S per pass (per input pixel for the transposed layer), x3 for
a step; "% probe" is the fraction of the fp32 peak measured in the same run (bf16: of the bf16
peak). Depthwise layers are memory-bound: for them the step's bytes (x and dy read twice, y
and dx written, in the compute dtype: 3 (|x| + |dy|)) over its time is also given as a
fraction of one core's copy bandwidth (bench/bandwidth.py's measurement, bytes read).
Medians over `repeats` alternating rounds.
--passes also times our three passes alone (the forward, the input gradient alone, the
kernel gradient alone: XLA drops the passes a lone gradient does not need; a transposed
layer's forward is the backward by data of the strided convolution it transposes, and so on).
Writes bench/results/<cpu-kind>/conv_kinds.json, keeping the rows of layers and dtypes not
measured this time.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bandwidth import CHUNK, POOL

import common  # noqa: E402

import jax_brgemm as jb  # noqa: E402

# name: (N, H = W, C, K, R = S, groups, rhs dilation, transposed stride, label)
LAYERS = {
    "dw3": (32, 56, 144, 144, 3, 144, 1, 1, "MobileNetV2 depthwise 3x3"),
    "dw7": (16, 56, 96, 96, 7, 96, 1, 1, "ConvNeXt-T depthwise 7x7"),
    "resnext": (16, 28, 256, 256, 3, 32, 1, 1, "ResNeXt 3x3, 32 groups"),
    "dilated": (8, 64, 256, 256, 3, 1, 2, 1, "DeepLab 3x3, dilation 2"),
    "transposed": (8, 64, 128, 64, 3, 1, 1, 2, "U-Net transposed 3x3, stride 2"),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DN = ("NHWC", "HWIO", "NHWC")


def geometry(h, r, dil, up):
    """(padding pairs, lhs dilation, output size): SAME for a convolution, flax's
    ConvTranspose 'SAME' (lax.conv_transpose's pads) for a transposed one."""
    if up > 1:  # up * h outputs: r + up - 2 pads in all, the larger half first (as lax)
        lo = (r + up - 1) // 2
        return ((lo, r + up - 2 - lo),) * 2, up, h * up
    pad = (r - 1) * dil // 2
    return ((pad, pad),) * 2, 1, h


def flops_of(n, h, c, k, r, g, up):
    return 2.0 * n * h * h * k * (c // g) * r * r  # per input pixel = per output pixel unless up > 1


def step(f):
    """One training step's passes: y, and the gradients of x and w for a cotangent dy."""
    return jax.jit(lambda x, w, dy: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(f, x, w)))


def contenders(name, n, dtype, torch):
    _, h, c, k, r, g, dil, up, _ = LAYERS[name]
    pads, ldil, o = geometry(h, r, dil, up)
    rng = np.random.default_rng(h + c + k + r)
    x = jnp.asarray(rng.standard_normal((n, h, h, c)), dtype)
    w = jnp.asarray(rng.standard_normal((r, r, c // g, k)) / np.sqrt(r * r * c // g), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((n, o, o, k)), dtype)
    kw = dict(padding=pads, rhs_dilation=(dil, dil), lhs_dilation=(ldil, ldil), feature_group_count=g)

    def ours(x, w):
        return jb.conv2d(x, w, dtype=dtype, **kw)

    def xla(x, w):  # flax's computation: the kernel cast to the compute dtype
        return jax.lax.conv_general_dilated(x, w.astype(dtype), (1, 1), dimension_numbers=DN, **kw)

    out = {"jax_brgemm": (step(ours), (x, w, dy)), "xla": (step(xla), (x, w, dy))}
    out["passes"] = {  # ours, one pass at a time
        "fwd": (jax.jit(ours), (x, w)),
        "dx": (jax.jit(lambda x, w, dy: jax.vjp(lambda x: ours(x, w), x)[1](dy)[0]), (x, w, dy)),
        "dw": (jax.jit(lambda x, w, dy: jax.vjp(lambda w: ours(x, w), w)[1](dy)[0]), (x, w, dy))}
    if torch is not None:
        tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        cl = torch.channels_last
        F = torch.nn.functional
        tx = torch.from_numpy(np.array(x, np.float32)).permute(0, 3, 1, 2).to(tdt).contiguous(memory_format=cl)
        tdy = torch.from_numpy(np.array(dy, np.float32)).permute(0, 3, 1, 2).to(tdt).contiguous(memory_format=cl)
        if up > 1:  # ConvTranspose2d's weight is (C_in, C_out, R, S), the kernel flipped
            tw = torch.from_numpy(np.array(w[::-1, ::-1])).permute(2, 3, 0, 1).to(tdt)
            op = lambda x, w: F.conv_transpose2d(x, w, None, up, (r - 1) // 2, up - 1)  # noqa: E731
        else:
            tw = torch.from_numpy(np.array(w)).permute(3, 2, 0, 1).to(tdt)
            op = lambda x, w: F.conv2d(x, w, None, 1, (r - 1) * dil // 2, dil, g)  # noqa: E731
        tw = tw.contiguous(memory_format=cl)
        tx.requires_grad_(True)
        tw.requires_grad_(True)

        def t_step():
            y = op(tx, tw)
            return y, torch.autograd.grad(y, (tx, tw), tdy)

        out["torch"] = (t_step, ())
    return out, o


def bandwidth_gbs(repeats=5):
    """One core's copy bandwidth from beyond L2, as bench/bandwidth.py measures it."""
    pool, dst = np.ones(POOL, np.uint8), np.empty(CHUNK, np.uint8)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(POOL // CHUNK):
            np.copyto(dst, pool[i * CHUNK:(i + 1) * CHUNK])
        rates.append(POOL / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def main(argv=None):
    p = common.arg_parser(__doc__, 3, 0.0)
    p.add_argument("--scale", type=int, default=4, help="divide every mini-batch by this (default 4)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--passes", action="store_true", help="also time our forward, dx and dw passes alone")
    p.add_argument("--only", default="", help="time only these contenders (comma-separated; for quick checks)")
    args = p.parse_args(argv)
    torch = common.torch_or_none()
    peak = common.measure_peak()
    bw = bandwidth_gbs()
    print(f"measured peak: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s; copy "
          f"bandwidth {bw:.1f} GB/s; kernel ISA {jb.isa()}; torch {torch.__version__ if torch else 'no'}",
          flush=True)
    rows = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for name in args.layers.split(","):
            full_n, h, c, k, r, g, dil, up, label = LAYERS[name]
            n = max(1, full_n // args.scale)
            cont, o = contenders(name, n, dtype, torch)
            passes = cont.pop("passes")
            if args.only:
                cont = {v: f for v, f in cont.items() if v in args.only.split(",")}
            samples = common.interleaved({v: f for v, (f, _) in cont.items()},
                                         {v: a for v, (_, a) in cont.items()},
                                         repeats=args.repeats, min_time=args.min_time)
            flops = 3 * flops_of(n, h, c, k, r, g, up)
            med = {v: statistics.median(s) for v, s in samples.items()}
            row = {"dtype": dname, "layer": name, "label": label, "n": n, "h": h, "c": c, "k": k, "r": r,
                   "groups": g, "dilation": dil, "transposed_stride": up, "flops": flops,
                   "seconds": {v: common.stats(s) for v, s in samples.items()},
                   "gflops": {v: flops / t / 1e9 for v, t in med.items()}}
            row["probe_fraction"] = row["gflops"]["jax_brgemm"] / peak[dname]
            if "xla" in med:
                row["vs_xla"] = med["xla"] / med["jax_brgemm"]
            if "torch" in med:
                row["vs_torch"] = med["torch"] / med["jax_brgemm"]
            if g == c:  # depthwise: bytes moved by the step over the copy bandwidth
                es = jnp.dtype(dtype).itemsize
                row["bytes"] = float(es * 3 * (n * h * h * c + n * o * o * k))  # 3 passes, each |x| + |dy|
                row["bandwidth_fraction"] = row["bytes"] / med["jax_brgemm"] / 1e9 / bw
            if args.passes:
                ps = common.interleaved({v: f for v, (f, _) in passes.items()},
                                        {v: a for v, (_, a) in passes.items()},
                                        repeats=args.repeats, min_time=args.min_time)
                row["pass_seconds"] = {v: common.stats(t) for v, t in ps.items()}
                row["pass_gflops"] = {v: flops / 3 / statistics.median(t) / 1e9 for v, t in ps.items()}
                if g == c:  # each pass reads two tensors and writes one (x, dy, y / dx)
                    one = float(jnp.dtype(dtype).itemsize * (n * h * h * c + n * o * o * k))
                    row["pass_bandwidth_fraction"] = {v: one / statistics.median(t) / 1e9 / bw
                                                      for v, t in ps.items()}
            rows.append(row)
            print(f"{dname:8s} {label:32s} N={n:2d} " +
                  "  ".join(f"{v} {gf:7.1f}" for v, gf in row["gflops"].items()) +
                  f"  | {100 * row['probe_fraction']:5.1f}% probe" +
                  (f", {row['vs_xla']:.2f}x xla" if "vs_xla" in row else "") +
                  (f", {row['vs_torch']:.2f}x torch" if "vs_torch" in row else "") +
                  (f", {100 * row['bandwidth_fraction']:.0f}% of bandwidth" if "bandwidth_fraction" in row else ""),
                  flush=True)
            if "pass_gflops" in row:
                print("         passes: " + "  ".join(
                    f"{v} {gf:6.1f} GFLOP/s (best {flops / 3 / row['pass_seconds'][v]['min'] / 1e9:5.1f}, "
                    f"{100 * gf / peak[dname]:4.1f}% probe" +
                    (f", {100 * row['pass_bandwidth_fraction'][v]:.0f}% bw" if "pass_bandwidth_fraction" in row else "")
                    + ")" for v, gf in row["pass_gflops"].items()), flush=True)
    for r in rows:  # the run's conditions on each row: a later run of some layers keeps the others
        r.update(peak_gflops=peak, bandwidth_gbs=bw, scale=args.scale)
    order = {(d, name): i for i, (d, name) in enumerate((d, name) for d in DTYPES for name in LAYERS)}
    rows = common.with_earlier_rows("conv_kinds", rows, lambda r: (r["dtype"], r["layer"]),
                                    lambda r: order.get((r["dtype"], r["layer"])))
    path = common.write_results("conv_kinds", {"peak_gflops": peak, "bandwidth_gbs": bw, "scale": args.scale,
                                               "repeats": args.repeats, "torch": torch.__version__ if torch else None,
                                               "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
