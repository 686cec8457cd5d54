"""Unmodified Flax models with and without ``jax_brgemm.accelerate()``, side by side.

    python bench/bench_accelerate.py [--repeats 9] [--min-time 0.2]

Models written against stock Flax only, in the style of the Flax examples. In flax.linen: an
MLP 784-1024-1024-1024-10, the MNIST example's CNN, a small ResNet with BatchNorm, an RNN
classifier (2 stacked nn.RNN(nn.OptimizedLSTMCell(128)) over the 28 rows of an image, then
Dense) and the sst2 example's shape of text classifier (nn.Embed, a bidirectional LSTM whose
two directions are the example's SimpleLSTM: nn.scan over a method that calls
nn.OptimizedLSTMCell(256); a Dense head) on 48 tokens. In flax.nnx: the NNX MNIST
tutorial's CNN (two nnx.Conv, average pooling, two nnx.Linear), the RNN classifier as
nnx.RNN(nnx.OptimizedLSTMCell) + nnx.Linear, and a small Vision Transformer (7x7 patches of
the image as 16 tokens, two pre-LayerNorm encoder blocks of nnx.MultiHeadAttention with 4
heads over 64 features and a GELU MLP of 128, mean pooling, nnx.Linear head). And models of
today's convolution kinds (bench/conv_models.py): MobileNetV2- and ConvNeXt-style
(depthwise 3x3 / 7x7), ResNeXt-style (32-group 3x3) and a small U-Net (strided
convolutions down, ConvTranspose up, skips). Trained on batches of 28x28 images (N=256 for
the MLPs and the RNNs, 64 for the convolution-kind models, 128 otherwise) or of token ids
(N=64) with optax SGD + momentum (the row mlp_adamw: the MLP with optax.adamw), fp32 and
bf16 (dtype=bfloat16 modules). One training step is one jitted function; "stock" is
traced outside the context, "accelerate" inside it; timed round-robin in one process, the
speed-up taken round by round (median and spread of stock / accelerate per round). Where
accelerate()'s dispatch policy left layers stock, accelerate(policy=False) (every layer on
the kernels) is timed in the same rounds too, as the last column. Each
row has the layer calls that ran on the kernels out of those accelerate() saw (its report's
records; NNX layers, which have no path, are recorded by class and sizes, so identical
ones share a record) and the ones left stock. Writes
bench/results/<cpu-kind>/accelerate.{json,png}.
"""

from __future__ import annotations

import functools
import statistics

import flax.linen as nn
import jax
from flax import nnx
import jax.numpy as jnp
import numpy as np
import optax

import common
import conv_models
from conv_models import Model
import jax_brgemm as jb


class MLP(Model):
    @nn.compact
    def __call__(self, x, train=True):
        x = x.reshape((x.shape[0], -1))
        for _ in range(3):
            x = nn.relu(nn.Dense(1024, dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x)


class CNN(Model):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Conv(32, (3, 3), dtype=self.dtype)(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(64, (3, 3), dtype=self.dtype)(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(256, dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x)


class ResNet(Model):
    @nn.compact
    def __call__(self, x, train=True):
        norm = lambda: nn.BatchNorm(use_running_average=not train, dtype=self.dtype)
        x = nn.relu(norm()(nn.Conv(32, (3, 3), use_bias=False, dtype=self.dtype)(x)))
        for features, stride in ((32, 1), (64, 2), (128, 2)):
            y = nn.relu(norm()(nn.Conv(features, (3, 3), stride, use_bias=False, dtype=self.dtype)(x)))
            y = norm()(nn.Conv(features, (3, 3), use_bias=False, dtype=self.dtype)(y))
            if x.shape != y.shape:
                x = norm()(nn.Conv(features, (1, 1), stride, use_bias=False, dtype=self.dtype)(x))
            x = nn.relu(x + y)
        return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


class RNN(Model):  # an RNN classifier: images as 28 rows of 28 pixels, 2 LSTM-128 + Dense
    @nn.compact
    def __call__(self, x, train=True):
        x = x.reshape(x.shape[:3])
        for _ in range(2):
            x = nn.RNN(nn.OptimizedLSTMCell(128, dtype=self.dtype))(x)
        return nn.Dense(10, dtype=self.dtype)(x[:, -1])


SST2_VOCAB, SST2_TOKENS = 8192, 48


class SST2Direction(Model):  # sst2's SimpleLSTM: nn.scan over a method calling the cell
    features: int = 256

    @functools.partial(nn.transforms.scan, variable_broadcast="params", in_axes=1, out_axes=1,
                       split_rngs={"params": False})
    @nn.compact
    def __call__(self, carry, x):
        return nn.OptimizedLSTMCell(self.features, dtype=self.dtype)(carry, x)


class SST2(Model):  # sst2's text classifier: embedding, bidirectional scanned LSTM, Dense head
    @nn.compact
    def __call__(self, tokens, train=True):
        x = nn.Embed(SST2_VOCAB, 300, dtype=self.dtype)(tokens)
        carry = nn.OptimizedLSTMCell(256, parent=None).initialize_carry(
            jax.random.key(0), x[:, 0].shape)
        _, forward = SST2Direction(self.dtype, name="forward")(carry, x)
        _, backward = SST2Direction(self.dtype, name="backward")(carry, x[:, ::-1])
        x = jnp.concatenate([forward, backward[:, ::-1]], -1)
        return nn.Dense(2, dtype=self.dtype)(jnp.mean(x, axis=1))


class NnxCNN(nnx.Module):  # the CNN of flax's NNX MNIST tutorial
    def __init__(self, *, dtype=None, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.linear1 = nnx.Linear(7 * 7 * 64, 256, dtype=dtype, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        x = nnx.relu(self.linear1(x.reshape((x.shape[0], -1))))
        return self.linear2(x)


class NnxRNN(nnx.Module):  # the RNN classifier in NNX: 2 LSTM-128 over the rows + Linear
    def __init__(self, *, dtype=None, rngs: nnx.Rngs):
        self.rnns = nnx.List([nnx.RNN(nnx.OptimizedLSTMCell(n, 128, dtype=dtype, rngs=rngs))
                              for n in (28, 128)])
        self.head = nnx.Linear(128, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[:3])
        for rnn in self.rnns:
            x = rnn(x)
        return self.head(x[:, -1])


class NnxEncoderBlock(nnx.Module):  # pre-LayerNorm: attention, then a GELU MLP, each residual
    def __init__(self, features, heads, hidden, *, dtype=None, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(features, dtype=dtype, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, features, dtype=dtype, decode=False,
                                                rngs=rngs)
        self.norm2 = nnx.LayerNorm(features, dtype=dtype, rngs=rngs)
        self.mlp1 = nnx.Linear(features, hidden, dtype=dtype, rngs=rngs)
        self.mlp2 = nnx.Linear(hidden, features, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp2(nnx.gelu(self.mlp1(self.norm2(x))))


class NnxViT(nnx.Module):  # a small Vision Transformer: 7x7 patches, 2 blocks, mean pooling
    def __init__(self, *, dtype=None, rngs: nnx.Rngs, features=64, patch=7):
        self.patch = patch
        tokens = (28 // patch) ** 2
        self.embed = nnx.Linear(patch * patch, features, dtype=dtype, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (tokens, features)))
        self.blocks = nnx.List([NnxEncoderBlock(features, 4, 2 * features, dtype=dtype, rngs=rngs)
                                for _ in range(2)])
        self.norm = nnx.LayerNorm(features, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(features, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        n, p = x.shape[0], self.patch
        x = x.reshape(n, 28 // p, p, 28 // p, p).transpose(0, 1, 3, 2, 4)
        x = self.embed(x.reshape(n, -1, p * p)) + self.position[...]
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(self.norm(x), axis=1))


MODELS = {"mlp": (MLP, 256), "mlp_adamw": (MLP, 256), "cnn": (CNN, 128), "resnet": (ResNet, 128),
          "rnn": (RNN, 256), "sst2": (SST2, 64), "nnx_cnn": (NnxCNN, 128), "nnx_rnn": (NnxRNN, 256),
          "nnx_vit": (NnxViT, 128), "mobilenetv2": (conv_models.MobileNetV2, 64),
          "convnext": (conv_models.ConvNeXt, 64), "resnext": (conv_models.ResNeXt, 64),
          "unet": (conv_models.UNet, 64)}
DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}


def optimizer(name):
    if name.endswith("_adamw"):
        return optax.adamw(1e-3, weight_decay=1e-4)
    return optax.sgd(0.01, momentum=0.9)


def train_step(model, opt):
    def step(variables, opt_state, x, labels):
        params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}

        def loss(p):
            logits, new_state = model.apply({"params": p, **state}, x, mutable=list(state))
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
            return loss.mean(), new_state

        grads, new_state = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return {"params": optax.apply_updates(params, updates), **new_state}, opt_state

    return step


def nnx_train_step(graphdef, opt):
    """The same step for an NNX model: its state merged into the model, nnx.grad over the
    parameters, the state split off again."""
    def step(state, opt_state, x, labels):
        def loss(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                   labels).mean()

        model = nnx.merge(graphdef, state)
        grads = nnx.grad(loss)(model)
        params = nnx.state(model, nnx.Param)
        updates, opt_state = opt.update(grads, opt_state, params)
        nnx.update(model, optax.apply_updates(params, updates))
        return nnx.state(model), opt_state

    return step


def contenders(name, dtype):
    """The stock and accelerated training steps, compiled, with their arguments; the layer
    calls on the kernels ("accelerated/seen") and the report's lines for those left stock."""
    cls, n = MODELS[name]
    rng = np.random.default_rng(0)
    if cls is SST2:
        x = jnp.asarray(rng.integers(0, SST2_VOCAB, (n, SST2_TOKENS)), jnp.int32)
        labels = jnp.asarray(rng.integers(0, 2, n))
    else:
        x = jnp.asarray(rng.standard_normal((n, 28, 28, 1)), jnp.float32)
        labels = jnp.asarray(rng.integers(0, 10, n))
    opt = optimizer(name)
    if issubclass(cls, nnx.Module):
        graphdef, state = nnx.split(cls(dtype=dtype, rngs=nnx.Rngs(0)))
        make_step = lambda: nnx_train_step(graphdef, opt)  # noqa: E731
        args = (state, opt.init(nnx.state(nnx.merge(graphdef, state), nnx.Param)))
    else:
        model = cls(dtype=dtype)
        variables = model.init(jax.random.key(0), x)
        make_step = lambda: train_step(model, opt)  # noqa: E731
        args = (variables, opt.init(variables["params"]))
    args += (x, labels)
    stock = jax.jit(make_step()).lower(*args).compile()
    with jb.accelerate() as acc:
        fast = jax.jit(make_step()).lower(*args).compile()
    accelerated = sum(c.accelerated for c in acc.calls)
    calls = {"on_kernels": f"{accelerated}/{len(acc.calls)}",
             "stock": [str(c) for c in acc.calls if not c.accelerated]}
    out = {"stock": (stock, args), "accelerate": (fast, args)}
    if any("dispatch policy" in c.reason for c in acc.calls):  # what the policy declined
        with jb.accelerate(policy=False):
            out["kernels"] = (jax.jit(make_step()).lower(*args).compile(), args)
    return out, calls


def main(argv=None):
    p = common.arg_parser(__doc__, 9, 0.2)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args(argv)
    rows = []
    for dname, dtype in DTYPES.items():
        for name in args.models:
            cont, calls = contenders(name, dtype)
            samples = common.interleaved({k: v[0] for k, v in cont.items()},
                                         {k: v[1] for k, v in cont.items()},
                                         repeats=args.repeats, min_time=args.min_time)
            med = {k: statistics.median(v) for k, v in samples.items()}
            rounds = [s / a for s, a in zip(samples["stock"], samples["accelerate"])]
            row = {"model": name, "dtype": dname, "batch": MODELS[name][1],
                   "accelerated_calls": calls["on_kernels"], "stock_calls": calls["stock"],
                   "seconds": {k: common.stats(v) for k, v in samples.items()},
                   "speedup": statistics.median(rounds), "speedup_rounds": common.stats(rounds)}
            if "kernels" in samples:  # every layer on the kernels, accelerate(policy=False)
                row["kernels_speedup"] = statistics.median(
                    s / k for s, k in zip(samples["stock"], samples["kernels"]))
            rows.append(row)
            print(f"{name:9s} {dname:8s} stock {1e3 * med['stock']:8.2f} ms  accelerate "
                  f"{1e3 * med['accelerate']:8.2f} ms  | {row['speedup']:.2f}x ({min(rounds):.2f}-"
                  f"{max(rounds):.2f}; {calls['on_kernels']} layer calls on the kernels)" +
                  (f"; policy=False {row['kernels_speedup']:.2f}x" if "kernels_speedup" in row else ""),
                  flush=True)
    order = {(m, d): i for i, (d, m) in enumerate((d, m) for d in DTYPES for m in MODELS)}
    rows = common.with_earlier_rows("accelerate", rows, lambda r: (r["model"], r["dtype"]),
                                    lambda r: order.get((r["model"], r["dtype"])))
    common.write_results("accelerate", {"repeats": args.repeats, "min_time": args.min_time, "rows": rows})
    labels = [f"{r['model']} {r['dtype']}" for r in rows]
    common.plot_bars("accelerate", labels,
                     {k: [1e3 * r["seconds"][k]["median"] for r in rows] for k in ("stock", "accelerate")},
                     "ms per training step (median, lower is better)",
                     f"Unmodified Flax models, with and without jax_brgemm.accelerate() ({jb.isa()})")
    print(f"\n{common.machine().get('cpu', '?')} ({common.cpu_kind()}, {jb.isa()})")
    print("\n| model | dtype | batch | stock ms | accelerate ms | speedup (rounds) | layer calls on the kernels "
          "| policy=False |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, a = r["seconds"]["stock"], r["seconds"]["accelerate"]
        print(f"| {r['model']} | {r['dtype']} | {r['batch']} | {1e3 * s['median']:.2f} "
              f"({1e3 * s['min']:.2f}-{1e3 * s['max']:.2f}) | {1e3 * a['median']:.2f} "
              f"({1e3 * a['min']:.2f}-{1e3 * a['max']:.2f}) | {r['speedup']:.2f}x ({r['speedup_rounds']['min']:.2f}-"
              f"{r['speedup_rounds']['max']:.2f}) | {r['accelerated_calls']} | "
              + (f"{r['kernels_speedup']:.2f}x |" if "kernels_speedup" in r else " |"))


if __name__ == "__main__":
    main()
