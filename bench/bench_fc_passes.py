"""The fully-connected passes alone at given shapes, against PyTorch's matmuls on the same
operands: the forward ``x @ W``, the input gradient ``dz @ W^T`` and the weight update
``x^T @ dz`` (jax_brgemm's ``ops.fc_passes`` primitives, one jitted call each; torch:
``F.linear`` / ``@`` on tensors made once, W already transposed and in the compute dtype).

    python bench/bench_fc_passes.py [--repeats 9] [--min-time 0.05] [--shapes 1024,768,3072 ...]
                                    [--dtypes float32 bfloat16]

Default shapes (N, C, K): a BERT-base layer's at 8 x 128 tokens (768 <-> 768, 768 <-> 3072)
and N = 2048, C = K = 4096. jax_brgemm's weight is the float32 parameter (cast to bf16 inside
the call, as a Flax bf16 model's is); torch's is bf16 already. GFLOP/s = 2 N C K / median
seconds; % of the machine's probe (AMX's for bf16 where the CPU has it); ratios round by
round. Writes bench/results/<cpu-kind>/fc_passes.json.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

import common
import jax_brgemm as jb
from jax_brgemm.ops import fc_passes as fp

SHAPES = ((1024, 768, 768), (1024, 768, 3072), (1024, 3072, 768), (2048, 4096, 4096))
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def contenders(n, c, k, dtype, torch):
    """{pass: {name: fn}} at one shape and dtype."""
    rng = np.random.default_rng(n + c + k)
    x = jnp.asarray(rng.standard_normal((n, c)), dtype)
    w = jnp.asarray(rng.standard_normal((c, k)) * 0.02, jnp.float32)
    dz = jnp.asarray(rng.standard_normal((n, k)), dtype)
    fwd = jax.jit(lambda x, w: fp.forward(x, w, None, fp.NONE)[0])
    bwd = jax.jit(fp.backward_data)
    upd = jax.jit(lambda x, dz: fp.weight_update(x, dz, (c, k), jnp.float32, False)[0])
    out = {"fwd": {"jax_brgemm": lambda: jax.block_until_ready(fwd(x, w))},
           "bwd": {"jax_brgemm": lambda: jax.block_until_ready(bwd(dz, w))},
           "upd": {"jax_brgemm": lambda: jax.block_until_ready(upd(x, dz))}}
    if torch is not None:
        tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        as_t = lambda a: torch.from_numpy(np.array(a, np.float32)).to(tdt)  # noqa: E731
        tx, tw, tdz = as_t(x), as_t(w).T.contiguous(), as_t(dz)
        out["fwd"]["torch"] = lambda: torch.nn.functional.linear(tx, tw)
        out["bwd"]["torch"] = lambda: tdz @ tw
        out["upd"]["torch"] = lambda: tdz.T @ tx
    return out


def main(argv=None):
    p = common.arg_parser(__doc__, 9, 0.05)
    p.add_argument("--shapes", nargs="+", default=[",".join(map(str, s)) for s in SHAPES], help="N,C,K")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    args = p.parse_args(argv)
    torch = common.torch_or_none()
    peak = common.measure_peak()
    print(f"{common.cpu_name()}; kernel ISA {jb.isa()}; probe fp32 {peak['float32']:.0f}, bf16 "
          f"{peak['bfloat16']:.0f} GFLOP/s; torch {'yes' if torch else 'not installed'}", flush=True)
    rows = []
    for dname in args.dtypes:
        for shape in args.shapes:
            n, c, k = (int(v) for v in shape.split(","))
            flops = 2.0 * n * c * k
            for pas, fns in contenders(n, c, k, DTYPES[dname], torch).items():
                samples = common.interleaved(fns, {name: () for name in fns}, repeats=args.repeats,
                                             min_time=args.min_time)
                row = {"dtype": dname, "n": n, "c": c, "k": k, "pass": pas, **common.summarize(samples, flops)}
                row["peak_fraction"] = row["gflops"]["jax_brgemm"] / peak[dname]
                if "torch" in samples:
                    r = [t / j for t, j in zip(samples["torch"], samples["jax_brgemm"])]
                    row["vs_torch"], row["vs_torch_range"] = statistics.median(r), [min(r), max(r)]
                rows.append(row)
                print(f"{dname:8s} N={n:<5d} C={c:<5d} K={k:<5d} {pas}: jax_brgemm {row['gflops']['jax_brgemm']:6.0f} "
                      f"GFLOP/s ({100 * row['peak_fraction']:4.1f} %)" +
                      (f", torch {row['gflops']['torch']:6.0f}, {row['vs_torch']:.2f}x torch "
                       f"({row['vs_torch_range'][0]:.2f}-{row['vs_torch_range'][1]:.2f})" if torch else ""), flush=True)
    print("wrote", common.write_results("fc_passes", {"peak_gflops": peak, "repeats": args.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
