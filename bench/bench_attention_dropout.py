"""What attention dropout costs: the attention's training step (jax.grad of a weighted sum
of its output in q, k, v) without dropout, with Flax's broadcast keep-mask (one (T, S) mask
for the batch and heads, Flax's default) and with one mask per (B, N), on the kernels;
against Flax's own dropout attention (stock, broadcast mask) and PyTorch's
F.scaled_dot_product_attention(dropout_p=) when torch is installed, side by side.

    python bench/bench_attention_dropout.py [--repeats 7] [--min-time 0.1] [--rate 0.1] [--t 128,512]

Shapes (B, T, N, H) = (8, T, 12, 64), self-attention, float32 and bfloat16. Prints each
contender's median milliseconds and its ratio to the kernels without dropout; writes
bench/results/<cpu>/attention_dropout.json.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import common  # noqa: E402

import jax_brgemm as jb  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def contenders(t, dtype, rate, torch):
    """{name: (fn, args)}: one training step of each contender at (8, t, 12, 64)."""
    rng = np.random.default_rng(t)
    q, k, v, do = (jnp.asarray(rng.standard_normal((8, t, 12, 64)), dtype) for _ in range(4))
    key = jax.random.key(1)
    attention = {
        "kernels": lambda q, k, v: jb.dot_product_attention(q, k, v),
        "kernels_broadcast_mask": lambda q, k, v: jb.dot_product_attention(q, k, v, dropout_rate=rate,
                                                                           dropout_rng=key),
        "kernels_mask_per_head": lambda q, k, v: jb.dot_product_attention(
            q, k, v, dropout_rate=rate, dropout_rng=key, broadcast_dropout=False),
        "flax_broadcast_mask": lambda q, k, v: nn.dot_product_attention(q, k, v, dropout_rate=rate, dropout_rng=key,
                                                                        deterministic=False),
    }
    out = {}
    for name, f in attention.items():
        weighted = lambda q, k, v, f=f: jnp.sum((f(q, k, v) * do).astype(jnp.float32))
        out[name] = (jax.jit(jax.grad(weighted, (0, 1, 2))), (q, k, v))
    if torch is not None:
        tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        tq, tk, tv = (torch.from_numpy(np.asarray(a, np.float32).transpose(0, 2, 1, 3).copy()).to(tdt)
                      .requires_grad_(True) for a in (q, k, v))
        tdo = torch.from_numpy(np.asarray(do, np.float32).transpose(0, 2, 1, 3).copy()).to(tdt)

        def t_train():
            for a in (tq, tk, tv):
                a.grad = None
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, dropout_p=rate).backward(tdo)
            return tq.grad

        out["torch_mask_per_head"] = (t_train, ())
    return out


def main(argv=None):
    p = common.arg_parser(__doc__, 7, 0.1)
    p.add_argument("--rate", type=float, default=0.1)
    p.add_argument("--t", default="128,512", help="sequence lengths, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args(argv)
    torch = common.torch_or_none()
    rows = []
    for dname in args.dtypes.split(","):
        for t in (int(x) for x in args.t.split(",")):
            cont = contenders(t, DTYPES[dname], args.rate, torch)
            samples = common.interleaved({k: f for k, (f, _) in cont.items()}, {k: a for k, (_, a) in cont.items()},
                                         repeats=args.repeats, min_time=args.min_time)
            row = {"dtype": dname, "b": 8, "t": t, "heads": 12, "h": 64, "rate": args.rate,
                   "seconds": {k: common.stats(v) for k, v in samples.items()}}
            base = row["seconds"]["kernels"]["median"]
            print(f"{dname:8s} T={t:<4d} " + "  ".join(f"{k} {1e3 * s['median']:7.1f} ms (x{s['median'] / base:.2f})"
                                                     for k, s in row["seconds"].items()), flush=True)
            rows.append(row)
    path = common.write_results("attention_dropout", {"repeats": args.repeats, "min_time": args.min_time,
                                                      "torch": torch.__version__ if torch else None, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
