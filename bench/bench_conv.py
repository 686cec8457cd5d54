"""Convolution benchmark: jb.conv2d vs stock XLA (lax.conv_general_dilated, what
flax.linen.Conv runs) and PyTorch CPU (oneDNN, when torch is installed), side by side in one
process, over every distinct convolution layer of ResNet-50 v1.5 (the paper's Table 2 with
the stride on the bottleneck's 3x3, with each layer's multiplicity in the network).

    python bench/bench_conv.py [--n 4] [--repeats 7] [--min-time 0.1] [--dtypes float32,bfloat16]
                               [--quick] [--layers 1,4,8]
    python bench/bench_conv.py --resnet50-step [--n 4] [--repeats 5] [--dtypes float32]
    python bench/bench_conv.py --dtypes float32 --precisions bf16_3x bf16 [--quick]

--resnet50-step instead times one whole ResNet-50 v1.5 training step (224x224 inputs, 1000
classes, BatchNorm in train mode, forward + backward + SGD update, one jitted function) with
impl="brgemm" vs impl="xla" on the same parameters, round-robin, and reports images/s
(median, min-max); writes bench/results/<cpu-kind>/resnet50_step.json.

--precisions bf16_3x ... adds, for float32, jb.conv2d traced under
jax.default_matmul_precision of each (jax_brgemm.precision's names), its products emulated
from bfloat16 ones ("jax_brgemm_bf16_3x", ...; ratios to "jax_brgemm", our exact float32, in
"vs_float32"); with bf16, also PyTorch's one-pass bf16 mode for float32 convolutions
("torch_bf16"). Writes conv_precisions.json then, no plots.

Passes (ResNet's convolutions have no bias; BatchNorm follows them):

  fwd   y = conv(x, w)
  bwd   dx from dy (the dual convolution)            jax.vjp w.r.t. x only
  upd   dw from x and dy                             jax.vjp w.r.t. w only
  step  y, dx and dw: one jitted jax.vjp w.r.t. both (3x the flops)
  train (weighted only) fwd + bwd + upd of every layer but the stem's bwd (its input is the
        image, whose gradient a training step never computes), from the per-pass timings

GFLOP/s count 2 N P Q K C R S per pass. The weighted efficiency of a pass is the paper's
(sum_i n_i F_i) / (sum_i n_i t_i) over the layer set, as GFLOP/s and as a fraction of the
machine's peak measured by the probe in the same run. Every contender is timed round-robin
(common.interleaved); medians and min-max over `repeats` samples. bf16 runs bf16 activations
and fp32 weights cast inside the call (Flax's dtype=bfloat16). Writes bench/results/<cpu-kind>/conv.json
and conv.png (training steps per layer), conv_passes.png (weighted efficiency per pass).
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

import common  # noqa: E402

import jax_brgemm as jb  # noqa: E402
from jax_brgemm import precision  # noqa: E402

# ResNet-50 v1.5's distinct convolutions, one line per stage, each as (H = W of the input,
# C, K, R = S, stride, multiplicity); the layer ids number them from 1 in this order.
STAGES = (
    [(224, 3, 64, 7, 2, 1)],  # stem
    [(56, 64, 256, 1, 1, 4), (56, 64, 64, 1, 1, 1), (56, 64, 64, 3, 1, 3), (56, 256, 64, 1, 1, 2)],
    [(56, 256, 128, 1, 1, 1), (56, 128, 128, 3, 2, 1), (28, 128, 512, 1, 1, 4),
     (56, 256, 512, 1, 2, 1), (28, 512, 128, 1, 1, 3), (28, 128, 128, 3, 1, 3)],
    [(28, 512, 256, 1, 1, 1), (28, 256, 256, 3, 2, 1), (14, 256, 1024, 1, 1, 6),
     (28, 512, 1024, 1, 2, 1), (14, 1024, 256, 1, 1, 5), (14, 256, 256, 3, 1, 5)],
    [(14, 1024, 512, 1, 1, 1), (14, 512, 512, 3, 2, 1), (7, 512, 2048, 1, 1, 3),
     (14, 1024, 2048, 1, 2, 1), (7, 2048, 512, 1, 1, 2), (7, 512, 512, 3, 1, 2)],
)
RESNET50 = dict(enumerate((layer for stage in STAGES for layer in stage), start=1))
QUICK = (4, 8, 14, 23)
PASSES = ("fwd", "bwd", "upd", "step")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PAPER = {"fwd": 0.83, "bwd": 0.80, "upd": 0.736}  # the paper's weighted efficiencies


def out_size(h, r, stride):
    return (h + stride - 1) // stride  # SAME


def flops_of(n, h, c, k, r, stride):
    p = out_size(h, r, stride)
    return 2.0 * n * p * p * k * c * r * r


def contenders(n, h, c, k, r, stride, dtype, torch, accuracies=()):
    """{name: {pass: (fn, args)}} for one layer; float32 adds the emulated `accuracies`."""
    rng = np.random.default_rng(h * 7 + c + k + r)
    p = out_size(h, r, stride)
    x = jnp.asarray(rng.standard_normal((n, h, h, c)), dtype)
    w = jnp.asarray(rng.standard_normal((r, r, c, k)) / np.sqrt(r * r * c), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((n, p, p, k)), dtype)

    def xla(x, w):
        return jax.lax.conv_general_dilated(x, w.astype(dtype), (stride, stride), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def ours(x, w):
        return jb.conv2d(x, w, strides=stride, padding="SAME", dtype=dtype)

    def passes(f):
        return {
            "fwd": (jax.jit(f), (x, w)),
            "bwd": (jax.jit(lambda x, w, dy: jax.vjp(lambda x: f(x, w), x)[1](dy)), (x, w, dy)),
            "upd": (jax.jit(lambda x, w, dy: jax.vjp(lambda w: f(x, w), w)[1](dy)), (x, w, dy)),
            "step": (jax.jit(lambda x, w, dy: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(f, x, w))), (x, w, dy)),
        }

    out = {"jax_brgemm": passes(ours), "xla": passes(xla)}
    if dtype == jnp.float32:
        out.update({f"jax_brgemm_{a}": passes(common.under(a, ours)) for a in accuracies})
    if torch is not None:
        tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        cl = torch.channels_last
        tx = torch.from_numpy(np.array(x, np.float32)).permute(0, 3, 1, 2).to(tdt).contiguous(memory_format=cl)
        tw = torch.from_numpy(np.array(w)).permute(3, 2, 0, 1).to(tdt).contiguous(memory_format=cl)
        tdy = torch.from_numpy(np.array(dy, np.float32)).permute(0, 3, 1, 2).to(tdt).contiguous(memory_format=cl)
        pad = (r - 1) // 2  # PyTorch's ResNet: symmetric padding, the same output size
        F = torch.nn.functional
        conv_bwd = torch.ops.aten.convolution_backward

        def t_fwd():
            with torch.no_grad():
                return F.conv2d(tx, tw, None, stride, pad)

        def t_bwd(mask):
            def run():
                with torch.no_grad():
                    return conv_bwd(tdy, tx, tw, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1, mask)
            return run

        def t_step():
            with torch.no_grad():
                F.conv2d(tx, tw, None, stride, pad)
                return conv_bwd(tdy, tx, tw, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1,
                                [True, True, False])

        out["torch"] = {"fwd": (t_fwd, ()), "bwd": (t_bwd([True, False, False]), ()),
                        "upd": (t_bwd([False, True, False]), ()), "step": (t_step, ())}
        if "bf16" in accuracies and dtype == jnp.float32:
            out["torch_bf16"] = {k: (common.torch_one_bf16_product(torch, "conv", f), a)
                                 for k, (f, a) in out["torch"].items()}
    return out


def main(argv=None):
    p = common.arg_parser(__doc__, 7, 0.1)
    p.add_argument("--n", type=int, default=4, help="mini-batch (default 4)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--quick", action="store_true", help=f"layers {QUICK} only")
    p.add_argument("--layers", default="", help="comma-separated layer ids (default: all)")
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument("--resnet50-step", action="store_true",
                   help="time a whole ResNet-50 training step (images/s) instead of the layers")
    p.add_argument("--precisions", nargs="+", default=[], choices=[a for a in precision.HARNESS if a != "float32"],
                   help="float32 contenders whose products are emulated from bfloat16 ones")
    args = p.parse_args(argv)
    precision.EMULATE = precision.EMULATE or bool(args.precisions)  # as JAX_BRGEMM_EMULATE=1
    if args.resnet50_step:
        return resnet50_step(args)
    torch = common.torch_or_none()
    ids = [int(v) for v in args.layers.split(",") if v] or (list(QUICK) if args.quick else list(RESNET50))
    passes = [v for v in args.passes.split(",") if v]

    peak = common.measure_peak()
    print(f"measured peak: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s; "
          f"kernel ISA {jb.isa()}; torch {'yes' if torch else 'not installed'}; N={args.n}", flush=True)

    rows = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for lid in ids:
            h, c, k, r, stride, mult = RESNET50[lid]
            cont = contenders(args.n, h, c, k, r, stride, dtype, torch, args.precisions)
            for pas in passes:
                fns = {name: cont[name][pas][0] for name in cont}
                fargs = {name: cont[name][pas][1] for name in cont}
                samples = common.interleaved(fns, fargs, repeats=args.repeats, min_time=args.min_time)
                flops = flops_of(args.n, h, c, k, r, stride) * (3 if pas == "step" else 1)
                row = {"dtype": dname, "id": lid, "h": h, "c": c, "k": k, "r": r, "stride": stride,
                       "multiplicity": mult, "n": args.n, "pass": pas, "flops": flops,
                       "seconds": {name: common.stats(v) for name, v in samples.items()},
                       "gflops": {name: flops / statistics.median(v) / 1e9 for name, v in samples.items()}}
                row["peak_fraction"] = row["gflops"]["jax_brgemm"] / peak[dname]
                row["vs_xla"] = row["gflops"]["jax_brgemm"] / row["gflops"]["xla"]
                if "torch" in row["gflops"]:
                    row["vs_torch"] = row["gflops"]["jax_brgemm"] / row["gflops"]["torch"]
                row["vs_float32"] = {name: row["gflops"][name] / row["gflops"]["jax_brgemm"]
                                     for name in row["gflops"] if name.startswith("jax_brgemm_")}
                rows.append(row)
                print(f"{dname:8s} id {lid:2d} {h:3d}x{h:<3d} {c:4d}->{k:<4d} {r}x{r} s{stride} {pas:4s} " +
                      "  ".join(f"{name} {row['gflops'][name]:6.1f}" for name in row["gflops"]) +
                      f"  | {100 * row['peak_fraction']:5.1f}% of peak, {row['vs_xla']:.2f}x xla", flush=True)

    weighted = weighted_efficiency(rows, peak)
    for w in weighted:
        print(f"weighted {w['dtype']:8s} {w['pass']:4s} " +
              "  ".join(f"{name} {g:6.1f} GFLOP/s ({100 * w['peak_fraction'][name]:.1f}%)"
                        for name, g in w["gflops"].items()) +
              f"  | {w['vs_xla']:.2f}x xla" + (f", {w['vs_torch']:.2f}x torch" if "vs_torch" in w else "") +
              "".join(f", {name} {v:.2f}x our float32" for name, v in w["vs_float32"].items()) +
              (f"  (paper: {100 * PAPER[w['pass']]:.1f}%)" if w["pass"] in PAPER else ""))
    common.write_results("conv_precisions" if args.precisions else "conv", {
        "peak_gflops": peak, "n": args.n, "repeats": args.repeats, "min_time": args.min_time, "torch": bool(torch),
        "layers": ids, "precisions": args.precisions, "rows": rows, "weighted": weighted, "paper_weighted": PAPER})
    if not args.precisions:  # the plots show the main suite
        plots(rows, weighted, peak)


def resnet50_step(args):
    """Whole ResNet-50 training step, impl="brgemm" vs impl="xla": images/s."""
    import optax

    from jax_brgemm.models import ResNet50

    n = args.n
    x = jax.random.normal(jax.random.key(0), (n, 224, 224, 3))
    labels = jax.random.randint(jax.random.key(1), (n,), 0, 1000)
    rows = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        models = {"jax_brgemm": ResNet50(num_classes=1000, impl="brgemm", dtype=dtype),
                  "xla": ResNet50(num_classes=1000, impl="xla", dtype=dtype)}
        variables = models["xla"].init(jax.random.key(2), x, train=False)  # identical trees
        tx = optax.sgd(0.01, momentum=0.9, nesterov=True)
        opt_state = tx.init(variables["params"])

        def make_step(model):
            def loss_fn(params, stats):
                logits, new = model.apply({"params": params, "batch_stats": stats}, x, train=True,
                                          mutable=["batch_stats"])
                loss = optax.softmax_cross_entropy_with_integer_labels(
                    logits.astype(jnp.float32), labels).mean()
                return loss, new["batch_stats"]

            @jax.jit
            def step(params, stats, opt_state):
                (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), stats, opt_state, loss

            return step

        fns = {name: make_step(m) for name, m in models.items()}
        fargs = {name: (variables["params"], variables["batch_stats"], opt_state) for name in fns}
        samples = common.interleaved(fns, fargs, repeats=args.repeats, min_time=args.min_time)
        ips = {name: sorted(n / t for t in v) for name, v in samples.items()}
        row = {"dtype": dname, "n": n, "seconds": {k: common.stats(v) for k, v in samples.items()},
               "images_per_s": {k: common.stats(v) for k, v in ips.items()}}
        row["vs_xla"] = row["images_per_s"]["jax_brgemm"]["median"] / row["images_per_s"]["xla"]["median"]
        rows.append(row)
        print(f"resnet50 step {dname:8s} N={n}: " + "  ".join(
            f"{k} {v['median']:.2f} img/s ({v['min']:.2f}-{v['max']:.2f})" for k, v in row["images_per_s"].items())
            + f"  | {row['vs_xla']:.2f}x xla", flush=True)
    common.write_results("resnet50_step", {"n": n, "repeats": args.repeats, "rows": rows})
    return 0


STEM = 1  # its input is the image: a training step never computes that gradient


def weighted_efficiency(rows, peak):
    """The paper's weighted efficiency per (dtype, pass): sum n_i F_i / sum n_i t_i; and
    "train", the same over the passes a ResNet-50 training step runs (fwd, bwd and upd of
    every layer, except the stem's bwd), from the per-pass timings."""
    out = []
    for dname in dict.fromkeys(r["dtype"] for r in rows):
        passes = list(dict.fromkeys(r["pass"] for r in rows))
        if {"fwd", "bwd", "upd"} <= set(passes):
            passes.append("train")
        for pas in passes:
            if pas == "train":
                sel = [r for r in rows if r["dtype"] == dname and r["pass"] in ("fwd", "bwd", "upd")
                       and not (r["pass"] == "bwd" and r["id"] == STEM)]
            else:
                sel = [r for r in rows if r["dtype"] == dname and r["pass"] == pas]
            names = list(sel[0]["gflops"])
            work = sum(r["multiplicity"] * r["flops"] for r in sel)
            g = {name: work / sum(r["multiplicity"] * r["seconds"][name]["median"] for r in sel) / 1e9
                 for name in names}
            w = {"dtype": dname, "pass": pas, "gflops": g,
                 "peak_fraction": {name: v / peak[dname] for name, v in g.items()},
                 "vs_xla": g["jax_brgemm"] / g["xla"]}
            if "torch" in g:
                w["vs_torch"] = g["jax_brgemm"] / g["torch"]
            w["vs_float32"] = {name: v / g["jax_brgemm"] for name, v in g.items() if name.startswith("jax_brgemm_")}
            out.append(w)
    return out


def plots(rows, weighted, peak):
    short = {"float32": "f32", "bfloat16": "bf16"}
    steps = [r for r in rows if r["pass"] == "step"] or rows
    names = list(steps[0]["gflops"])
    common.plot_bars("conv", [f"{short[r['dtype']]} #{r['id']} {r['h']} {r['c']}-{r['k']} {r['r']}x{r['r']}"
                              f"/{r['stride']}" for r in steps],
                     {n: [r["gflops"][n] for r in steps] for n in names}, "GFLOP/s (median)",
                     f"ResNet-50 conv layers, {steps[0]['pass']} (N={steps[0]['n']}), {jb.isa()}",
                     hline=peak["float32"], hline_label="fp32 peak (probe)")
    common.plot_bars("conv_passes", [f"{short[w['dtype']]} {w['pass']}" for w in weighted],
                     {n: [100 * w["peak_fraction"][n] for w in weighted] for n in names},
                     "weighted efficiency, % of peak", "ResNet-50 conv layers, weighted (paper, §4.1)")


if __name__ == "__main__":
    main()
