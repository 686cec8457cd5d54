"""Each op family's float32 training step at every ``precision=`` accuracy, the emulation
forced (as ``JAX_BRGEMM_EMULATE=1``), against the exact float32 step: the measurements that
decide ``jax_brgemm.precision.EMULATED`` for this CPU's multiplier.

    python bench/bench_precisions.py [--repeats 7] [--min-time 0.1] [--families dense conv ...]

A step is one jitted forward and every gradient (a vdot with a fixed cotangent):

- dense: ``jb.dense`` N = 256, C = K = 1024, ReLU, with bias;
- conv: ``jb.conv2d`` 3x3 128 -> 128 at (8, 28, 28), SAME;
- attention: ``jb.dot_product_attention`` (8, 128 tokens, 12 heads, 64);
- lstm: ``jb.lstm`` 512 -> 512, 64 rows, 50 steps.

Contenders are timed round-robin in one process; each accuracy's speed-up over exact float32
is taken round by round (median and range). Writes bench/results/<cpu-kind>/precisions.json.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

import common
import jax_brgemm as jb
from jax_brgemm import precision

ALGORITHM = {"float32": "F32_F32_F32", "bf16_6x": "BF16_BF16_F32_X6", "bf16_3x": "BF16_BF16_F32_X3",
             "bf16": "BF16_BF16_F32"}


def cases(rng):
    """{family: (f(operands, precision) -> output, operands)}, float32 unit-scale operands."""
    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale)

    return {
        "dense": (lambda o, p: jb.dense(o[0], o[1], o[2], activation="relu", precision=p),
                  (normal(256, 1024), normal(1024, 1024, scale=0.03), normal(1024))),
        "conv": (lambda o, p: jb.conv2d(o[0], o[1], padding="SAME", precision=p),
                 (normal(8, 28, 28, 128), normal(3, 3, 128, 128, scale=0.03))),
        "attention": (lambda o, p: jb.dot_product_attention(*o, precision=p),
                      tuple(normal(8, 128, 12, 64) for _ in range(3))),
        "lstm": (lambda o, p: jb.lstm(o[0], *o[1:], precision=p)[1],
                 (normal(64, 50, 512), normal(512, 2048, scale=0.03), normal(512, 2048, scale=0.03),
                  normal(2048, scale=0.1))),
    }


def step(f, operands, algorithm):
    """The jitted step: every operand's gradient of <f(operands), cotangent>."""
    cot = jax.eval_shape(lambda o: f(o, algorithm), operands)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(cot.shape, dtype=np.float32))
    return jax.jit(jax.grad(lambda o: jnp.vdot(f(o, algorithm), ct)))


def main(argv=None):
    p = common.arg_parser(__doc__, 7, 0.1)
    p.add_argument("--families", nargs="+", choices=("dense", "conv", "attention", "lstm"),
                   default=["dense", "conv", "attention", "lstm"])
    args = p.parse_args(argv)
    precision.EMULATE = True  # as JAX_BRGEMM_EMULATE=1: every accuracy from its products
    print(f"CPU: {common.cpu_name()}; kernel ISA {jb.isa()}; bfloat16 multiplied with {precision.multiplier()}\n")
    print("| step | float32 ms | " + " | ".join(f"{a} vs float32" for a in list(ALGORITHM)[1:]) + " |\n"
          "|---|---|---|---|---|")
    rows = []
    for family, (f, operands) in cases(np.random.default_rng(0)).items():
        if family not in args.families:
            continue
        fns = {a: step(f, operands, alg) for a, alg in ALGORITHM.items()}
        samples = common.interleaved(fns, {a: (operands,) for a in fns}, repeats=args.repeats,
                                     min_time=args.min_time)
        speedup = {}
        for a in list(ALGORITHM)[1:]:
            r = [e / s for e, s in zip(samples["float32"], samples[a])]
            speedup[a] = {"median": statistics.median(r), "range": [min(r), max(r)]}
        rows.append({"family": family, "seconds": {a: common.stats(v) for a, v in samples.items()},
                     "vs_float32": speedup})
        print(f"| {family} | {1e3 * statistics.median(samples['float32']):.2f} | " +
              " | ".join(f"{s['median']:.2f}x ({s['range'][0]:.2f}-{s['range'][1]:.2f})" for s in speedup.values())
              + " |", flush=True)
    print("wrote", common.write_results("precisions", {"repeats": args.repeats, "multiplier": precision.multiplier(),
                                                       "rows": rows}))


if __name__ == "__main__":
    main()
