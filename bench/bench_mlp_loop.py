"""The main job's training loop, side by side: `python -m jax_brgemm.train mlp` with the
BRGEMM layers and with stock XLA, and a PyTorch CPU loop of the same model, batch and
optimizer, in turn (A B C A B C ...), each in its own process.

    python bench/bench_mlp_loop.py [--dtype float32|bfloat16] [--rounds 3] [--epochs 2]
    python bench/bench_mlp_loop.py --torch-loop --dtype bfloat16   # the PyTorch loop alone

The harness runs are closed-division runs with the suite's hyperparameters, stopped after
--epochs epochs; their figure is the harness's own throughput (training images per second
of the train loop, evaluation excluded). The PyTorch loop: the MLP 784-1024-1024-1024-10
(ReLU) in nn.Linear layers, batch 256, SGD with Nesterov momentum 0.9 (learning rate 0.05,
one warm-up epoch, cosine decay over 16 epochs, as the suite's table), on Fashion-MNIST-shaped
batches (60,000 images a epoch, shuffled); bf16 is torch.autocast(bfloat16) with fp32
parameters, as the harness's bf16 keeps fp32 parameters. Its figure is images per second of
the same train loop. Prints the medians, the spread and the ratios; the ratio of each round
is taken pair by pair, so the machine's drift hits all contenders alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

BATCH, TRAIN, FEATURES = 256, 60_000, (784, 1024, 1024, 1024, 10)


def torch_loop(dtype: str, epochs: int) -> float:
    """Images per second of the PyTorch train loop (the median epoch)."""
    torch = common.torch_or_none()
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(FEATURES[:-1], FEATURES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(FEATURES) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    steps = TRAIN // BATCH
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    total = 16 * steps

    def lr_at(step):  # one warm-up epoch, then cosine to 0 (the suite's schedule)
        if step < steps:
            return (step + 1) / steps
        return 0.5 * (1 + math.cos(math.pi * (step - steps) / (total - steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    images = torch.rand(TRAIN, 784)
    labels = torch.randint(0, 10, (TRAIN,))
    loss_fn = torch.nn.CrossEntropyLoss()
    rates = []
    for _ in range(epochs):
        order = torch.randperm(TRAIN)
        t0 = time.perf_counter()
        for s in range(steps):
            idx = order[s * BATCH:(s + 1) * BATCH]
            x, y = images[idx], labels[idx]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                loss = loss_fn(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        rates.append(steps * BATCH / (time.perf_counter() - t0))
    return statistics.median(rates)


def harness(impl: str, dtype: str, epochs: int) -> float:
    with tempfile.TemporaryDirectory() as logs:
        subprocess.run([sys.executable, "-m", "jax_brgemm.train", "mlp", "--impl", impl, "--dtype",
                        dtype, "--max-epochs", str(epochs), "--log-dir", logs],
                       check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (summary,) = Path(logs).glob("*/summary.json")
        return json.loads(summary.read_text())["runs"][0]["throughput"]


def torch_process(dtype: str, epochs: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--torch-loop", "--dtype", dtype, "--epochs",
                          str(epochs)], check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2, help="epochs of each run (default 2)")
    p.add_argument("--torch-loop", action="store_true", help="run the PyTorch loop alone and print img/s")
    args = p.parse_args(argv)
    if args.torch_loop:
        print(f"torch {args.dtype} img/s {torch_loop(args.dtype, args.epochs):.1f}")
        return
    contenders = {"brgemm": lambda: harness("brgemm", args.dtype, args.epochs),
                  "xla": lambda: harness("xla", args.dtype, args.epochs),
                  "torch": lambda: torch_process(args.dtype, args.epochs)}
    rates = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name, run in contenders.items():
            rates[name].append(run())
        print(f"round {r + 1}: " + "  ".join(f"{n} {v[-1]:,.0f}" for n, v in rates.items()), flush=True)
    print(f"\nmlp training loop, {args.dtype}, img/s ({common.cpu_name()}; "
          f"median of {args.rounds} rounds, min-max)")
    for name, v in rates.items():
        print(f"  {name:7s} {statistics.median(v):9,.0f}  ({min(v):,.0f}-{max(v):,.0f})")
    ratios = {}
    for other in ("xla", "torch"):
        r = [a / b for a, b in zip(rates["brgemm"], rates[other])]
        ratios[other] = {"pairs": r, **common.stats(r)}
        print(f"  brgemm / {other:5s} {statistics.median(r):.3f}  "
              f"({min(r):.3f}-{max(r):.3f}, pair by pair)")
    path = common.write_results(f"mlp_loop_{args.dtype}", {"epochs": args.epochs, "rounds": args.rounds,
                                                            "img_per_s": rates, "brgemm_vs": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
