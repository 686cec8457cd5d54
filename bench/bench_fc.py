"""Fully-connected layer and MLP benchmark: jb.dense / jb.nn.Dense vs stock flax.linen.Dense
(and PyTorch nn.Linear when torch is installed), side by side in one process.

    python bench/bench_fc.py [--repeats 9] [--min-time 0.1] [--quick]

Layer suite: C = K in {256, 512, 1024}, N in {64, 256, 1024}, ReLU layers with bias,
fp32 and bf16 (bf16 compute with fp32 parameters, Flax's dtype=bfloat16):

  fwd   y = relu(x W + b)
  bwd   dx = (dy * relu'(y)) W^T          the vjp of the forward, given its residuals
  upd   dW = x^T (dy * relu'(y)), db      idem (XLA drops the part a pass does not need)
  step  fwd + bwd + upd: one jitted jax.grad of the layer w.r.t. x, W and b

MLP suite: whole training steps (softmax cross-entropy, jax.grad, a generic optax step:
SGD with momentum, and AdamW; one jitted function donating parameters and optimizer state,
each call taking the previous one's result, as a training loop does) of models.MLP
impl="brgemm" vs impl="xla" with the same parameters: N=256 784-1024-1024-1024-10 and N=64
with the same 1024-wide layers. "jax_brgemm_fused" is the brgemm model's step built by
jax_brgemm.optim.train_step with the same optax optimizer marked (jax_brgemm.optim.sgd /
adamw: optax's own transformation and state), its step fused into the weight updates.
--mlp-only skips the layer suite, --tiny runs one tiny shape of each (for the tests). --precisions bf16_3x ... adds, for float32, the brgemm
layer and MLP traced under jax.default_matmul_precision of each (jax_brgemm.precision's
names), its products emulated from bfloat16 ones ("jax_brgemm_bf16_3x", ...); with bf16,
also PyTorch's one-pass bf16 mode for float32 matmuls ("torch_bf16").

GFLOP/s count 2 N C K per pass (3x that per layer step; 6 N sum(C K) per MLP step).
Every contender is timed round-robin (common.interleaved); medians and min-max over
`repeats` samples; ratios are taken round by round (pair by pair), median and min-max;
the machine's peak is measured by the probe in the same run; the CPU is named by vendor,
family, model and kernel ISA.
Writes bench/results/<cpu-kind>/fc.json (fc_precisions.json with --precisions) and fc.png
(layer steps), fc_passes.png, fc_mlp.png.
"""

from __future__ import annotations

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import common  # noqa: E402

import jax_brgemm as jb  # noqa: E402
from jax_brgemm import models  # noqa: E402
from jax_brgemm import optim as jbo  # noqa: E402
from jax_brgemm import precision  # noqa: E402

WIDTHS = (256, 512, 1024)
BATCHES = (64, 256, 1024)
PASSES = ("fwd", "bwd", "upd", "step")
MLP_CASES = ((256, (1024, 1024, 1024)), (64, (1024, 1024, 1024)))
OPTIMIZERS = {"sgd": lambda: jbo.sgd(0.01, momentum=0.9), "adamw": lambda: jbo.adamw(1e-3)}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}



# --- the FC layer -------------------------------------------------------------------------

def layer_contenders(n, c, dtype, torch, accuracies=()):
    """{name: {pass: (fn, args)}} for one layer shape and dtype."""
    rng = np.random.default_rng(n + c)
    x = jnp.asarray(rng.standard_normal((n, c)), dtype)
    w = jnp.asarray(rng.standard_normal((c, c)) / np.sqrt(c), jnp.float32)
    b = jnp.asarray(0.1 * rng.standard_normal(c), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((n, c)), dtype)
    params = {"params": {"kernel": w, "bias": b}}
    stock = fnn.Dense(c, dtype=dtype)

    def weighted(f):  # a scalar whose cotangent is dy
        return lambda x, p: jnp.sum((f(x, p) * dy).astype(jnp.float32))

    jb_layer = lambda x, p: jb.nn.Dense(c, activation="relu", dtype=dtype).apply(p, x)
    xla_layer = lambda x, p: jax.nn.relu(stock.apply(p, x))
    out = {}
    emulated = [(f"jax_brgemm_{a}", common.under(a, jb_layer)) for a in accuracies if dtype == jnp.float32]
    for name, layer in (("jax_brgemm", jb_layer), *emulated, ("flax", xla_layer)):
        # The backward passes alone, given the forward's residuals: the vjp closure is a
        # pytree of them, passed into the jitted function. What a pass does not need is
        # dropped by XLA (dx alone: no weight update; the update alone: no dx).
        _, vjp = jax.vjp(layer, x, params)
        out[name] = {
            "fwd": (jax.jit(layer), (x, params)),
            "bwd": (jax.jit(lambda f, dy: f(dy)[0]), (vjp, dy)),
            "upd": (jax.jit(lambda f, dy: f(dy)[1]), (vjp, dy)),
            "step": (jax.jit(jax.grad(weighted(layer), (0, 1))), (x, params)),
        }
    if torch is not None:
        tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        tx = torch.from_numpy(np.array(x, np.float32)).to(tdt)
        tdy = torch.from_numpy(np.array(dy, np.float32)).to(tdt)
        lin = torch.nn.Linear(c, c).to(tdt)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.asarray(w).T.copy()))
            lin.bias.copy_(torch.from_numpy(np.asarray(b)))
        ty = torch.relu(lin(tx)).detach()
        tw = lin.weight.detach()

        def t_fwd():
            with torch.no_grad():
                return torch.relu(lin(tx))

        def t_bwd():
            with torch.no_grad():
                return (tdy * (ty > 0)) @ tw

        def t_upd():
            with torch.no_grad():
                dz = tdy * (ty > 0)
                return dz.t() @ tx, dz.sum(0)

        txg = tx.clone().requires_grad_(True)

        def t_step():
            lin.zero_grad(set_to_none=True)
            txg.grad = None
            torch.relu(lin(txg)).backward(tdy)
            return txg.grad

        out["torch"] = {"fwd": (t_fwd, ()), "bwd": (t_bwd, ()), "upd": (t_upd, ()), "step": (t_step, ())}
        if "bf16" in accuracies and dtype == jnp.float32:
            out["torch_bf16"] = {k: (common.torch_one_bf16_product(torch, "matmul", f), a)
                                 for k, (f, a) in out["torch"].items()}
    return out


# --- the MLP training step ------------------------------------------------------------------

def mlp_contenders(n, features, dtype, torch, opt_name="sgd", accuracies=()):
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.uniform(0, 1, (n, 28, 28)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, n))
    opt = OPTIMIZERS[opt_name]()
    out = {}
    params = None
    for name, impl in (("jax_brgemm", "brgemm"), ("flax", "xla")):
        model = models.MLP(features=features, num_classes=10, activation="relu", impl=impl, dtype=dtype)
        if params is None:
            params = model.init(jax.random.key(0), x)

        def loss(p, model=model):
            logits = model.apply(p, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        def step(p, s, loss=loss):
            g = jax.grad(loss)(p)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s

        out[name] = _chained(step, params, opt)
        if impl == "brgemm":
            fused = jbo.train_step(loss, opt)
            out["jax_brgemm_fused"] = _chained(lambda p, s, fused=fused: fused(p, s)[:2], params, opt)
            for a in accuracies if dtype == jnp.float32 else ():
                out[f"jax_brgemm_{a}"] = _chained(common.under(a, step), params, opt)
    if torch is not None:
        tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        layers, widths = [], (784, *features)
        for a, b_ in zip(widths[:-1], widths[1:]):
            layers += [torch.nn.Linear(a, b_), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 10)).to(tdt)
        topt = (torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9) if opt_name == "sgd" else
                torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4))
        tx = torch.from_numpy(np.array(x).reshape(n, -1)).to(tdt)
        tl = torch.from_numpy(np.array(labels)).long()

        def t_step():
            topt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(tx).float(), tl).backward()
            topt.step()

        out["torch"] = (t_step, ())
        if "bf16" in accuracies and dtype == jnp.float32:
            out["torch_bf16"] = (common.torch_one_bf16_product(torch, "matmul", t_step), ())
    return out


def _chained(step, params, opt):
    """A training loop's calls: each donates its state and the next takes the result."""
    fn = jax.jit(step, donate_argnums=(0, 1))
    state = [jax.tree.map(jnp.copy, (params, opt.init(params)))]

    def call():
        state[0] = fn(*state[0])
        return state[0]

    return call, ()


# --- running and reporting ----------------------------------------------------------------

def main(argv=None):
    p = common.arg_parser(__doc__, 9, 0.1)
    p.add_argument("--quick", action="store_true", help="C=K=1024, N=256 and the MLPs only")
    p.add_argument("--tiny", action="store_true", help="N=8, C=K=32 and a 32-wide MLP: a check that it runs")
    p.add_argument("--mlp-only", action="store_true", help="the MLP steps only")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--precisions", nargs="+", default=[], choices=[a for a in precision.HARNESS if a != "float32"],
                   help="float32 contenders whose products are emulated from bfloat16 ones")
    args = p.parse_args(argv)
    precision.EMULATE = precision.EMULATE or bool(args.precisions)  # as JAX_BRGEMM_EMULATE=1
    torch = common.torch_or_none()

    peak = common.measure_peak()
    print(f"measured peak: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s "
          f"({', '.join(f'{k} {v:.0f}' for k, v in peak.items() if k.startswith('bfloat16_'))}); "
          f"kernel ISA {jb.isa()}; torch {'yes' if torch else 'not installed'}\nCPU: {common.cpu_name()}")

    layer_rows = []
    shapes = ([] if args.mlp_only else [(8, 32)] if args.tiny else [(256, 1024)] if args.quick else
              [(n, c) for c in WIDTHS for n in BATCHES])
    mlp_cases = ((8, (32, 32)),) if args.tiny else MLP_CASES
    for dname, dtype in ((d, DTYPES[d]) for d in args.dtypes):
        for n, c in shapes:
            cont = layer_contenders(n, c, dtype, torch, args.precisions)
            for pas in PASSES:
                fns = {name: cont[name][pas][0] for name in cont}
                fargs = {name: cont[name][pas][1] for name in cont}
                samples = common.interleaved(fns, fargs, repeats=args.repeats, min_time=args.min_time)
                flops = 2.0 * n * c * c * (3 if pas == "step" else 1)
                row = {"dtype": dname, "n": n, "c": c, "k": c, "pass": pas, "flops": flops,
                       **common.summarize(samples, flops)}
                row["peak_fraction"] = row["gflops"]["jax_brgemm"] / peak[dname]
                row["peak_fraction_fp32"] = row["gflops"]["jax_brgemm"] / peak["float32"]
                ratios(row, samples)
                layer_rows.append(row)
                print(f"{dname:8s} N={n:<5d} C=K={c:<5d} {pas:4s} " + "  ".join(
                    f"{k} {row['gflops'][k]:7.1f}" for k in row["gflops"]) +
                    f"  | {100 * row['peak_fraction']:5.1f}% of peak, {spread(row, 'flax')} flax", flush=True)

    mlp_rows = []
    for dname, dtype in ((d, DTYPES[d]) for d in args.dtypes):
        for (n, features), opt_name in [(case, o) for case in mlp_cases for o in OPTIMIZERS]:
            cont = mlp_contenders(n, features, dtype, torch, opt_name, args.precisions)
            samples = common.interleaved({k: v[0] for k, v in cont.items()},
                                         {k: v[1] for k, v in cont.items()},
                                         repeats=args.repeats, min_time=args.min_time)
            widths = (784, *features, 10)
            flops = 6.0 * n * sum(a * b for a, b in zip(widths[:-1], widths[1:]))
            row = {"dtype": dname, "n": n, "widths": list(widths), "optimizer": opt_name, "flops": flops,
                   **common.summarize(samples, flops)}
            med = {k: v["median"] for k, v in row["seconds"].items()}
            ratios(row, samples)
            row["peak_fraction"] = row["gflops"]["jax_brgemm"] / peak[dname]
            mlp_rows.append(row)
            print(f"MLP {dname:8s} N={n:<4d} {opt_name:5s} {'-'.join(map(str, widths))}: " + "  ".join(
                f"{k} {1e3 * med[k]:.2f} ms" for k in med) + f"  | {spread(row, 'flax')} flax"
                + (f", {spread(row, 'torch')} torch" if "torch" in med else "")
                + f"; fused {spread(row, 'flax', 'fused_')} flax"
                + (f", {spread(row, 'torch', 'fused_')} torch" if "torch" in med else ""), flush=True)

    name = "fc_mlp" if args.mlp_only else "fc"
    common.write_results(name + "_precisions" if args.precisions else name, {
        "peak_gflops": peak, "repeats": args.repeats, "min_time": args.min_time, "precisions": args.precisions,
        "torch": bool(torch), "layer": layer_rows, "mlp": mlp_rows})
    if not args.precisions:  # the plots show the main suite
        plots(layer_rows, mlp_rows, peak)
    print(markdown(layer_rows, mlp_rows, peak))
    print(f"(CPU: {common.cpu_name()})")


def ratios(row, samples):
    """The row's speedups over flax (and torch), round by round: vs_X the median, vs_X_range."""
    for other in ("flax", "torch"):
        if other in samples:
            r = common.pair_ratios(samples, "jax_brgemm", other)
            row[f"vs_{other}"], row[f"vs_{other}_range"] = r["median"], [r["min"], r["max"]]
            if "jax_brgemm_fused" in samples:
                r = common.pair_ratios(samples, "jax_brgemm_fused", other)
                row[f"fused_vs_{other}"], row[f"fused_vs_{other}_range"] = r["median"], [r["min"], r["max"]]


def spread(row, other, prefix=""):
    lo, hi = row[f"{prefix}vs_{other}_range"]
    return f"{row[f'{prefix}vs_{other}']:.2f}x ({lo:.2f}-{hi:.2f})"


def plots(layer_rows, mlp_rows, peak):
    if not layer_rows:
        return _plot_mlp(mlp_rows)
    steps = [r for r in layer_rows if r["pass"] == "step"]
    names = list(steps[0]["gflops"])
    short = {"float32": "f32", "bfloat16": "bf16"}
    label = lambda r: f"{short[r['dtype']]} N{r['n']} C{r['c']}"
    common.plot_bars("fc", [label(r) for r in steps], {n: [r["gflops"][n] for r in steps] for n in names},
                     "GFLOP/s (median)", f"FC layer fwd+bwd+upd (one jax.grad), {jb.isa()}",
                     hline=peak["float32"], hline_label="fp32 peak (probe)")
    passes = [r for r in layer_rows if r["n"] == 256 and r["pass"] != "step"]
    common.plot_bars("fc_passes", [f"{label(r)} {r['pass']}" for r in passes],
                     {n: [r["gflops"][n] for r in passes] for n in names},
                     "GFLOP/s (median)", "FC layer passes, N=256",
                     hline=peak["float32"], hline_label="fp32 peak (probe)")
    _plot_mlp(mlp_rows)


def _plot_mlp(mlp_rows):
    short = {"float32": "f32", "bfloat16": "bf16"}
    mnames = list(mlp_rows[0]["seconds"])
    common.plot_bars("fc_mlp", [f"{short[r['dtype']]} N{r['n']} {r['optimizer']}" for r in mlp_rows],
                     {n: [1e3 * r["seconds"][n]["median"] for r in mlp_rows] for n in mnames},
                     "ms per training step (median, lower is better)",
                     "MLP 784-1024-1024-1024-10 training step")


def _names(rows, field):
    """Every contender of the rows, in order of appearance (the emulated precisions run in
    float32 rows only)."""
    return list(dict.fromkeys(n for r in rows for n in r[field]))


def markdown(layer_rows, mlp_rows, peak):
    names = _names(layer_rows, "gflops")
    out = common.peak_table_head(peak, ["dtype", "N", "C=K", "pass"], names, "flax") if layer_rows else []
    for r in layer_rows:
        g, lo_hi = r["gflops"], r["gflops_range"]
        cells = [f"{g[n]:.0f} ({lo_hi[n][0]:.0f}-{lo_hi[n][1]:.0f})" if n in g else "-" for n in names]
        out.append(f"| {r['dtype']} | {r['n']} | {r['c']} | {r['pass']} | " + " | ".join(cells) +
                   f" | {100 * r['peak_fraction']:.0f}% | {spread(r, 'flax')} |" +
                   (f" {spread(r, 'torch')} |" if "vs_torch" in r else ""))
    mnames = _names(mlp_rows, "seconds")
    out += ["", "| MLP step | N | " + " | ".join(f"{n} ms" for n in mnames) + " | vs flax |" +
            (" vs torch |" if "torch" in mnames else ""), "|" + "---|" * (len(mnames) + 3 + ("torch" in mnames))]
    for r in mlp_rows:
        s = r["seconds"]
        cells = [f"{1e3 * s[n]['median']:.2f} ({1e3 * s[n]['min']:.2f}-{1e3 * s[n]['max']:.2f})" if n in s else "-"
                 for n in mnames]
        out.append(f"| {r['dtype']} {'-'.join(map(str, r['widths']))} {r['optimizer']} | {r['n']} | " +
                   " | ".join(cells) + f" | {spread(r, 'flax')} |" +
                   (f" {spread(r, 'torch')} |" if "vs_torch" in r else "") +
                   (f" fused {spread(r, 'flax', 'fused_')} flax |" if "fused_vs_flax" in r else ""))
    return "\n".join(out)


if __name__ == "__main__":
    main()
