"""The kernel custom calls in each bench_accelerate training step program, counted.

    python bench/count_kernel_calls.py [--models mlp cnn ...] [--json OUT]

For every model and dtype of ``bench/bench_accelerate.py``, the jitted ``jax.grad`` training
step is traced inside ``jax_brgemm.accelerate()`` (and ``accelerate(policy=False)``, every
layer on the kernels) and lowered, not compiled, nor run: ``jax.jit(step).lower(...)``'s
StableHLO text, whose ``custom_call @jb_...`` names are counted per target. A change to how
the ops are differentiated must keep every count the same or lower it. Not a timing. Writes
bench/results/<cpu-kind>/kernel_calls.json (or --json OUT): the dispatch policy's choices
depend on the CPU kind.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bench_accelerate as ba
import common
import jax_brgemm as jb

_CALL = re.compile(r"custom_call @(jb_\w+)")


def kernel_calls(text: str) -> dict:
    """``{target: count}`` of the ``jb_*`` custom calls in lowered StableHLO text."""
    return dict(sorted(collections.Counter(_CALL.findall(text)).items()))


def step_and_args(name, dtype):
    """The training step of bench_accelerate's model ``name`` and its arguments."""
    cls, n = ba.MODELS[name]
    rng = np.random.default_rng(0)
    if cls is ba.SST2:
        x = jnp.asarray(rng.integers(0, ba.SST2_VOCAB, (n, ba.SST2_TOKENS)), jnp.int32)
        labels = jnp.asarray(rng.integers(0, 2, n))
    else:
        x = jnp.asarray(rng.standard_normal((n, 28, 28, 1)), jnp.float32)
        labels = jnp.asarray(rng.integers(0, 10, n))
    opt = ba.optimizer(name)
    if issubclass(cls, nnx.Module):
        graphdef, state = nnx.split(cls(dtype=dtype, rngs=nnx.Rngs(0)))
        step = ba.nnx_train_step(graphdef, opt)
        args = (state, opt.init(nnx.state(nnx.merge(graphdef, state), nnx.Param)))
    else:
        model = cls(dtype=dtype)
        variables = model.init(jax.random.key(0), x)
        step = ba.train_step(model, opt)
        args = (variables, opt.init(variables["params"]))
    return step, args + (x, labels)


def count(name, dtype, policy=True):
    step, args = step_and_args(name, dtype)
    with jb.accelerate(policy=policy):
        text = jax.jit(step).lower(*args).as_text()
    return kernel_calls(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(ba.MODELS), choices=list(ba.MODELS))
    p.add_argument("--json", default=str(common.RESULTS / "kernel_calls.json"), help="where to write the counts")
    args = p.parse_args(argv)
    rows = []
    for dname, dtype in ba.DTYPES.items():
        for name in args.models:
            for policy in (True, False):
                calls = count(name, dtype, policy)
                rows.append({"model": name, "dtype": dname, "policy": policy,
                             "total": sum(calls.values()), "calls": calls})
                print(f"{name:12s} {dname:9s} {'policy' if policy else 'all   '} "
                      f"{rows[-1]['total']:4d}  {calls}", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
