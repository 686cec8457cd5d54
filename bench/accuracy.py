"""Accuracy of long fp32 reductions: jax_brgemm and stock XLA against a float64 reference.

Operands are uniform in [0, 1) (a nonzero mean, so rounding errors add up rather than
cancel). Each row is one reduction whose length is the number of products summed into each
output element: jb.brgemm over B * K, the dense weight and bias gradients over the batch,
the conv weight gradient over N * H * W. The error is max |out - ref| / max |ref|.

    python bench/accuracy.py            # the full sizes (about 2 GB of memory)
    python bench/accuracy.py --scale 0.1

Then each precision= (float32, and the bf16 emulation of ops/emulation.py forced: six, three
and one bfloat16 product) on unit-normal reductions of 10^3 to 10^6 products, a dense
layer's, a 3x3 convolution's, attention's and an LSTM layer's outputs, beside stock XLA's
fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_brgemm as jb
from jax_brgemm import precision
from jax_brgemm.ops.lstm import reference as lstm_reference
from common import arg_parser, write_results


def rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def uniform(rng, *shape):
    return rng.random(shape, dtype=np.float32)


def brgemm_case(rng, batch, k, m=8, n=8):
    a, b = uniform(rng, batch, m, k), uniform(rng, batch, k, n)
    ref = np.einsum("bmk,bkn->mn", a.astype(np.float64), b.astype(np.float64))
    ours = jax.jit(jb.brgemm)(a, b)
    stock = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->mn", a, b))(a, b)
    return {"products": batch * k}, {"jax_brgemm": ours, "xla": stock}, ref


def dense_grad_cases(rng, rows, c=16, k=16):
    x, dy, w = uniform(rng, rows, c), uniform(rng, rows, k), uniform(rng, c, k)
    b = np.zeros(k, np.float32)

    def grads(f):  # operands as arguments: XLA would constant-fold closed-over arrays
        return jax.jit(jax.grad(lambda w, b, x, dy: jnp.vdot(f(x, w, b), dy), argnums=(0, 1)))(w, b, x, dy)

    ours = grads(lambda x, w, b: jb.dense(x, w, b))
    stock = grads(lambda x, w, b: x @ w + b)
    ref_w = x.astype(np.float64).T @ dy.astype(np.float64)
    ref_b = dy.astype(np.float64).sum(0)
    return [({"products": rows}, {"jax_brgemm": ours[0], "xla": stock[0]}, ref_w),
            ({"products": rows}, {"jax_brgemm": ours[1], "xla": stock[1]}, ref_b)]


def conv_grad_case(rng, n, hw, c=16, k=16):
    x, dy, w = uniform(rng, n, hw, hw, c), uniform(rng, n, hw, hw, k), uniform(rng, 3, 3, c, k)

    def stock_conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def grad(f):
        return jax.jit(jax.grad(lambda w, x, dy: jnp.vdot(f(x, w), dy)))(w, x, dy)

    ours = grad(lambda x, w: jb.conv2d(x, w, padding="SAME"))
    stock = grad(stock_conv)
    # The float64 reference of the weight gradient: sum over pixels of x's shifted window
    # times dy, one (dr, ds) tap at a time.
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
    dy64 = dy.astype(np.float64).reshape(-1, k)
    ref = np.stack([np.stack([xp[:, r:r + hw, s:s + hw].reshape(-1, c).T @ dy64 for s in range(3)])
                    for r in range(3)])
    return {"products": n * hw * hw}, {"jax_brgemm": ours, "xla": stock}, ref


PRECISIONS = {"float32": None, "bf16_6x": "BF16_BF16_F32_X6", "bf16_3x": "BF16_BF16_F32_X3",
              "bf16": "BF16_BF16_F32"}


def precision_rows(rng, scale):
    """Each precision's error (the bf16 emulation forced) beside stock XLA's fp32, on
    unit-normal reductions of 10^3 to 10^6 products and on layers."""
    precision.EMULATE = True
    rows = []
    print("\n| reduction | " + " | ".join(PRECISIONS) + " | XLA fp32 |\n|---|---|---|---|---|---|")

    def row(name, ours, stock, a, b, ref):  # ours(a, b, precision), stock(a, b)
        errs = {p: rel_error(jax.jit(lambda a, b, v=v: ours(a, b, v))(a, b), ref) for p, v in PRECISIONS.items()}
        errs["xla"] = rel_error(jax.jit(stock)(a, b), ref)
        rows.append({"case": name, "error": errs})
        print(f"| {name} | " + " | ".join(f"{errs[p]:.1e}" for p in (*PRECISIONS, "xla")) + " |")

    shapes = [(f"brgemm K={k:,}", (1, 8, k), (1, k, 8)) for k in (10 ** 3, 10 ** 4, 10 ** 5, int(10 ** 6 * scale))]
    shapes.append(("dense 256x1024 @ 1024x1024", (1, 256, 1024), (1, 1024, 1024)))
    for name, a_shape, b_shape in shapes:
        a = rng.standard_normal(a_shape, dtype=np.float32)
        b = rng.standard_normal(b_shape, dtype=np.float32)
        ref = np.einsum("bmk,bkn->mn", a.astype(np.float64), b.astype(np.float64))
        row(name, lambda a, b, v: jb.brgemm(a, b, precision=v),
            lambda a, b: jnp.einsum("bmk,bkn->mn", a, b), a, b, ref)
    # a ResNet 3x3 layer's forward: 576 products per output, the parts along the channels
    x = rng.standard_normal((8, 28, 28, 64), dtype=np.float32)
    w = rng.standard_normal((3, 3, 64, 64), dtype=np.float32)

    def stock_conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    with jax.enable_x64(True):
        ref = np.asarray(stock_conv(x.astype(np.float64), w.astype(np.float64)))
    row("conv 3x3 64->64 (8, 28, 28)", lambda x, w, v: jb.conv2d(x, w, precision=v), stock_conv, x, w, ref)
    # attention (ViT-S heads) and an LSTM layer: the kernels split what they make themselves
    q, k, v = (rng.standard_normal((4, 256, 6, 64), dtype=np.float32) for _ in range(3))
    with jax.enable_x64(True):
        ref = np.asarray(jax.nn.dot_product_attention(*(a.astype(np.float64) for a in (q, k, v))))
    row("attention (4, 256, 6 heads, 64)", lambda q, kv, p: jb.dot_product_attention(q, *kv, precision=p),
        lambda q, kv: jax.nn.dot_product_attention(q, *kv), q, (k, v), ref)
    x = rng.standard_normal((32, 50, 256), dtype=np.float32)
    w = tuple(rng.standard_normal(shape, dtype=np.float32) / 16 for shape in ((256, 1024), (256, 1024), (1024,)))

    def stock_lstm(x, w):
        zeros = jnp.zeros((x.shape[0], 256), x.dtype)
        return lstm_reference(x, *w, zeros, zeros, False)[1]

    with jax.enable_x64(True):
        ref = np.asarray(stock_lstm(x.astype(np.float64), tuple(a.astype(np.float64) for a in w)))
    row("LSTM 256->256, 50 steps (32 rows)", lambda x, w, p: jb.lstm(x, *w, precision=p)[1], stock_lstm, x, w, ref)
    return rows


def main():
    p = arg_parser(__doc__, repeats=1)
    p.add_argument("--scale", type=float, default=1.0, help="shrink every reduction by this factor")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    s = args.scale
    cases = {"brgemm B*K": brgemm_case(rng, max(1, int(1024 * s)), 4096)}
    wgrad, bgrad = dense_grad_cases(rng, max(1, int(2 ** 20 * s)))
    cases["dense weight grad"], cases["dense bias grad"] = wgrad, bgrad
    cases["conv weight grad"] = conv_grad_case(rng, max(1, int(64 * s)), 64)
    rows = []
    print("| reduction | products per output | jax_brgemm error | XLA error | ratio |")
    print("|---|---|---|---|---|")
    for name, (info, outs, ref) in cases.items():
        errs = {k: rel_error(v, ref) for k, v in outs.items()}
        ratio = errs["jax_brgemm"] / errs["xla"] if errs["xla"] else float("inf")
        rows.append({"case": name, **info, "error": errs, "ratio": ratio})
        print(f"| {name} | {info['products']:,} | {errs['jax_brgemm']:.2e} | {errs['xla']:.2e} | {ratio:.2f}x |")
    by_precision = precision_rows(rng, s)
    print("wrote", write_results("accuracy", {"scale": s, "rows": rows, "precision_rows": by_precision}))


if __name__ == "__main__":
    main()
