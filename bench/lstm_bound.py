"""How fast can an LSTM training step go on this machine? The step's multiply work as three
plain GEMMs, timed with the fastest GEMMs at hand, side by side with the training steps.

    python bench/lstm_bound.py [--n 168] [--c 256 512 1024] [--repeats 7]

A training step (T = 50, fp32) multiplies as much as three GEMMs of the whole sequence:

  forward      [x | h] @ [W; R]         (T N) x (C + K)  @  (C + K) x 4K
  data grads   da @ [W; R]^T            (T N) x 4K       @  4K x (C + K)
  update       [x | h]^T @ da           (C + K) x (T N)  @  (T N) x 4K

Those three, run as single large GEMMs (no recurrence, no per-step barrier, no cell, no
re-blocking by the caller; operands laid out as each library likes), bound what any
implementation of the step can reach from below in time. Timed with jax_brgemm (jb.dense),
stock XLA (jnp.dot) and PyTorch (torch.mm), interleaved in rounds with the training steps
of jb.nn.LSTM, stock Flax and torch.nn.LSTM. For each round: the GEMM bound's rate over
Flax's step rate, i.e. the largest speed-up over Flax that the fastest of these GEMMs would
allow. Prints medians and ranges of the rounds; writes bench/results/<cpu-kind>/<name>.json.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402
import jax_brgemm as jb  # noqa: E402
from bench_lstm import T, contenders  # noqa: E402


def gemms(n, c, torch):
    """{library: (fn, args)}: the step's three GEMMs, one call each, in one function."""
    k, rows = c, n * T
    key = jax.random.split(jax.random.key(3), 3)
    xh = jax.random.normal(key[0], (rows, c + k), jnp.float32)
    xh_t = xh.T.copy()
    w = jax.random.normal(key[1], (c + k, 4 * k), jnp.float32) * 0.05
    w_t = w.T.copy()
    da = jax.random.normal(key[2], (rows, 4 * k), jnp.float32)
    out = {
        "gemm_jb": (jax.jit(lambda xh, w, da, w_t, xh_t: (jb.dense(xh, w), jb.dense(da, w_t), jb.dense(xh_t, da))),
                    (xh, w, da, w_t, xh_t)),
        "gemm_xla": (jax.jit(lambda xh, w, da: (xh @ w, da @ w.T, xh.T @ da)), (xh, w, da)),
    }
    if torch is not None:
        t = {name: torch.from_numpy(jax.device_get(v).copy()) for name, v in
             (("xh", xh), ("w", w), ("da", da))}

        def torch_gemms():
            return torch.mm(t["xh"], t["w"]), torch.mm(t["da"], t["w"].t()), torch.mm(t["xh"].t(), t["da"])

        out["gemm_torch"] = (torch_gemms, ())
    return out


def main(argv=None):
    p = common.arg_parser(__doc__, 7, 0.2)
    p.add_argument("--n", type=int, nargs="+", default=[168])
    p.add_argument("--c", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--name", default="lstm_bound", help="results file name (bench/results/<cpu-kind>/NAME.json)")
    args = p.parse_args(argv)
    torch = common.torch_or_none()
    peak = common.measure_peak()
    print(f"cpu {common.machine().get('cpu', '?')}; kernel ISA {jb.isa()}; "
          f"measured fp32 peak {peak['float32']:.0f} GFLOP/s; torch {'yes' if torch else 'no'}", flush=True)
    rows = []
    for c in args.c:
        for n in args.n:
            cont, _ = contenders(n, c, jnp.float32, torch)
            fns = {f"step_{name}": v["train"][0] for name, v in cont.items()}
            fargs = {f"step_{name}": v["train"][1] for name, v in cont.items()}
            for name, (fn, a) in gemms(n, c, torch).items():
                fns[name], fargs[name] = fn, a
            samples = common.interleaved(fns, fargs, repeats=args.repeats, min_time=args.min_time)
            flops = 3 * 2.0 * T * n * (2 * c) * 4 * c
            rate = {name: flops / statistics.median(s) / 1e9 for name, s in samples.items()}
            print(f"N={n} C=K={c}: " + ", ".join(f"{name} {r:.0f}" for name, r in rate.items()) + " GFLOP/s")
            best = [min(ts) for ts in zip(*(s for name, s in samples.items() if name.startswith("gemm_")))]
            bound = [f / b for f, b in zip(samples["step_flax"], best)]
            ours = [f / o for f, o in zip(samples["step_flax"], samples["step_jax_brgemm"])]
            print(f"  per round, over Flax's step: the fastest GEMMs' bound {statistics.median(bound):.2f}x "
                  f"({min(bound):.2f}-{max(bound):.2f}), jax_brgemm's step {statistics.median(ours):.2f}x "
                  f"({min(ours):.2f}-{max(ours):.2f}); the bound is "
                  f"{flops / statistics.median(best) / 1e9 / peak['float32']:.0%} of the peak", flush=True)
            rows.append({"t": T, "n": n, "c": c, "k": c, "flops": flops, "gflops": rate,
                         "seconds": {name: common.stats(s) for name, s in samples.items()},
                         "bound_vs_flax": common.stats(bound), "ours_vs_flax": common.stats(ours)})
    print(f"wrote {common.write_results(args.name, {'peak': peak, 'rows': rows})}")


if __name__ == "__main__":
    main()
