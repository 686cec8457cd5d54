"""Transformer training steps: a BERT-base encoder layer and a 2-layer causal LM written in
plain flax.linen, stock against the same code under ``jax_brgemm.accelerate()`` against
PyTorch's ``nn.TransformerEncoderLayer`` (when torch is installed), side by side in one run.

    python bench/bench_transformer.py [--repeats 5] [--dtypes float32 bfloat16] [--lengths 128 512]
                                      [--cases bert lm]

BERT-base layer: d = 768, 12 heads, MLP 3072 with GELU, post-LayerNorm, dropout 0.1 on the
attention probabilities, after attention and after the MLP; batch 8 x T tokens. The LM (the
lm1b example's shape): token embedding (vocabulary 30,000) and learned positions, two
pre-LN causal blocks of d = 512, 8 heads, MLP 2048, dropout 0.1, logits tied to the embedding;
batch 8 x 256 tokens. A step is one jitted forward + every gradient (softmax cross-entropy).
bfloat16 is Flax's ``dtype=bfloat16`` (float32 parameters) and PyTorch's ``autocast``.
GFLOP/s count the matrix products (3x the forward's for a step); % of the machine's probe
(AMX's for bf16 where the CPU has it). Ratios are taken round by round. Writes
bench/results/<cpu-kind>/transformer.json.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import common
import jax_brgemm as jb

BATCH = 8


class BertLayer(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train=True):
        y = nn.MultiHeadDotProductAttention(num_heads=12, dtype=self.dtype, dropout_rate=0.1,
                                            deterministic=not train)(x, x)
        x = nn.LayerNorm(dtype=self.dtype)(x + nn.Dropout(0.1, deterministic=not train)(y))
        y = nn.Dense(768, dtype=self.dtype)(nn.gelu(nn.Dense(3072, dtype=self.dtype)(x)))
        return nn.LayerNorm(dtype=self.dtype)(x + nn.Dropout(0.1, deterministic=not train)(y))


class CausalLM(nn.Module):
    dtype: jnp.dtype = jnp.float32
    vocab: int = 30000
    d: int = 512

    @nn.compact
    def __call__(self, tokens, train=True):
        embed = nn.Embed(self.vocab, self.d)
        x = embed(tokens) + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d))
        x = nn.Dropout(0.1, deterministic=not train)(x).astype(self.dtype)
        mask = nn.make_causal_mask(tokens)
        for _ in range(2):
            y = nn.MultiHeadDotProductAttention(num_heads=8, dtype=self.dtype, dropout_rate=0.1,
                                                deterministic=not train)(nn.LayerNorm(dtype=self.dtype)(x), mask=mask)
            x = x + nn.Dropout(0.1, deterministic=not train)(y)
            h = nn.Dense(2048, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
            x = x + nn.Dropout(0.1, deterministic=not train)(nn.Dense(self.d, dtype=self.dtype)(nn.relu(h)))
        return embed.attend(nn.LayerNorm(dtype=self.dtype)(x).astype(jnp.float32))


def bert_flops(t: int, d: int = 768) -> float:
    n = BATCH * t
    return 3 * (24.0 * n * d * d + 4.0 * BATCH * t * t * d)


def lm_flops(t: int = 256, d: int = 512, vocab: int = 30000) -> float:
    n = BATCH * t
    return 3 * (2 * (24.0 * n * d * d + 4.0 * BATCH * t * t * d) + 2.0 * n * d * vocab)


def flax_step(model, inputs, loss):
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, inputs)

    def step(params, key):
        return jax.grad(lambda p: loss(model.apply(p, inputs, rngs={"dropout": key})))(params)

    return params, step


def contenders(case: str, t: int, dtype, torch):
    rng = np.random.default_rng(t)
    if case == "bert":
        x = jnp.asarray(rng.standard_normal((BATCH, t, 768)), dtype)
        params, step = flax_step(BertLayer(dtype), x, lambda y: jnp.mean(y.astype(jnp.float32) ** 2))
    else:
        tokens = jnp.asarray(rng.integers(0, 30000, (BATCH, t)))
        xent = lambda logits: -jnp.mean(jnp.take_along_axis(  # noqa: E731
            jax.nn.log_softmax(logits), tokens[..., None], -1))
        params, step = flax_step(CausalLM(dtype), tokens, xent)
    key = jax.random.key(2)
    stock = jax.jit(step)
    with jb.accelerate() as acc:  # traced (and so run) on the kernels inside, its calls recorded
        jax.block_until_ready(stock(params, key))

    def accelerated():
        with jb.accelerate():
            return stock(params, key)

    fns = {"flax": lambda: stock(params, key), "accelerate": accelerated}
    if torch is not None:
        fns["torch"] = torch_step(torch, case, t, dtype)
    return fns, acc


def torch_step(torch, case, t, dtype):
    nn_ = torch.nn
    if case == "bert":
        model = nn_.TransformerEncoderLayer(768, 12, 3072, 0.1, "gelu", batch_first=True, norm_first=False)
        x = torch.randn(BATCH, t, 768)
        loss = lambda: (model(x) ** 2).mean()  # noqa: E731
    else:
        embed, pos = nn_.Embedding(30000, 512), nn_.Parameter(torch.randn(t, 512) * 0.02)
        blocks = nn_.ModuleList(nn_.TransformerEncoderLayer(512, 8, 2048, 0.1, "relu", batch_first=True,
                                                            norm_first=True) for _ in range(2))
        norm, tokens = nn_.LayerNorm(512), torch.randint(0, 30000, (BATCH, t))
        mask = nn_.Transformer.generate_square_subsequent_mask(t)
        model = nn_.ModuleList([embed, blocks, norm])

        def loss():
            x = nn_.functional.dropout(embed(tokens) + pos, 0.1)
            for b in blocks:
                x = b(x, src_mask=mask, is_causal=True)
            return nn_.functional.cross_entropy((norm(x) @ embed.weight.T).flatten(0, 1), tokens.flatten())
    model.train()
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == jnp.bfloat16):
            out = loss()
        out.backward()
    return step


def main(argv=None):
    p = common.arg_parser(__doc__, 5)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 512], help="the BERT layer's T")
    p.add_argument("--cases", nargs="+", default=["bert", "lm"], choices=["bert", "lm"])
    args = p.parse_args(argv)
    torch = common.torch_or_none()
    peak = common.measure_peak()
    print(f"CPU: {common.cpu_name()}; kernel ISA {jb.isa()}; probe fp32 {peak['float32']:.0f}, "
          f"bf16 {peak['bfloat16']:.0f} GFLOP/s; torch {'yes' if torch else 'not installed'}")
    rows = []
    cases = ([("bert", t, bert_flops(t)) for t in args.lengths] if "bert" in args.cases else []) + (
        [("lm", 256, lm_flops())] if "lm" in args.cases else [])
    for dname in args.dtypes:
        dtype = jnp.float32 if dname == "float32" else jnp.bfloat16
        for case, t, flops in cases:
            fns, acc = contenders(case, t, dtype, torch)
            samples = common.interleaved({k: f for k, f in fns.items()}, {k: () for k in fns},
                                         repeats=args.repeats, min_time=0)
            row = {"case": case, "t": t, "dtype": dname, "flops": flops, **common.summarize(samples, flops),
                   "on_kernels": sum(c.accelerated for c in acc.calls), "layer_calls": len(acc.calls),
                   "stock_calls": [str(c) for c in acc.calls if not c.accelerated]}
            for other in ("flax", "torch"):
                if other in samples:
                    r = common.pair_ratios(samples, "accelerate", other)
                    row[f"vs_{other}"], row[f"vs_{other}_range"] = r["median"], [r["min"], r["max"]]
            row["peak_fraction"] = row["gflops"]["accelerate"] / peak[dname]
            rows.append(row)
            ms = {k: 1e3 * v["median"] for k, v in row["seconds"].items()}
            print(f"{case} T={t} {dname}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()) +
                  f" | accelerate {row['gflops']['accelerate']:.0f} GFLOP/s ({100 * row['peak_fraction']:.0f} %), "
                  f"{row['vs_flax']:.2f}x flax" + (f", {row['vs_torch']:.2f}x torch" if "vs_torch" in row else "") +
                  f"; {row['on_kernels']}/{row['layer_calls']} layer calls on the kernels", flush=True)
            for c in row["stock_calls"]:
                print("    stock:", c)
    print("wrote", common.write_results("transformer", {"peak_gflops": peak, "repeats": args.repeats,
                                                        "torch": bool(torch), "rows": rows}))


if __name__ == "__main__":
    main()
