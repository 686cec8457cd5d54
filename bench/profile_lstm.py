"""Where jb.nn.LSTM's training step spends its time: each pass of the custom VJP timed
alone, on operands of the training step's shapes, with the minor page faults it takes.

    python bench/profile_lstm.py [--n 168] [--c 512] [--dtype float32] [--repeats 7]

Passes (T = 50, C = K):
  fwd          the forward without saving (what inference runs)
  fwd+save     the forward that also writes what the backward needs (gates, cell states,
               [x | h_prev]): the training step's forward
  bptt         backward through time: gate derivatives and dh_{t-1} = da_t @ R^T per step
  dx           dx = da @ W^T, one GEMM over every step
  upd          [dW; dR] = [x | h_prev]^T @ da, one GEMM over every step
  step         the whole jitted jax.grad, as bench_lstm.py's "train" times it

The faults column counts the minor page faults a call takes (getrusage): an output the
allocator maps afresh is faulted in page by page on its first write (each 4 KiB page a trap
and a zeroing in the kernel); memory the allocator reuses takes none. bench/common.py calls
jb.reuse_freed_memory(), as the training harness does, so the column shows whether the
passes still take any.
Interleaved, medians and ranges over `--repeats` rounds. Prints a table; writes nothing.
"""

from __future__ import annotations

import resource
import statistics

import flax.linen as fnn
import jax
import jax.numpy as jnp

import common  # noqa: E402

import jax_brgemm as jb  # noqa: E402
from jax_brgemm.ops import fc_passes, lstm as lstm_ops  # noqa: E402

T = 50


def passes(n, c, dtype):
    """{name: (jitted function, args, flops)} for every pass of one training step."""
    k = c
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (n, T, c), jnp.float32).astype(dtype)
    wi_k = (jax.random.normal(keys[1], (c, 4 * k)) * 0.05).astype(dtype)
    wh_k = (jax.random.normal(keys[2], (k, 4 * k)) * 0.05).astype(dtype)
    b = jnp.zeros((4 * k,), jnp.float32)
    c0, h0 = jnp.zeros((n, k), jnp.float32), jnp.zeros((n, k), dtype)

    fwd = jax.jit(lambda *a: lstm_ops.forward_call(*a, False, save=False)[0])
    fwd_save = jax.jit(lambda *a: lstm_ops.forward_call(*a, False, save=True))
    y, c_t, h_t, gates, cs, xh = fwd_save(x, wi_k, wh_k, b, c0, h0)
    dy = jax.random.normal(keys[3], y.shape, jnp.float32).astype(dtype)
    bptt = jax.jit(lambda *a: lstm_ops.bptt_call(*a, False))
    bptt_args = (wh_k, gates, cs, c0, dy, c_t, h_t)  # the final carry stands in for its gradient
    da = bptt(*bptt_args)[0]
    da2 = da.reshape(n * T, da.shape[2])  # the gradient and its rows' padding
    xh2 = xh.reshape(n * T, xh.shape[2])
    dx = jax.jit(fc_passes.backward_data)
    upd = jax.jit(lambda a, d: fc_passes.weight_update(a, d, (c + k, 4 * k), jnp.float32,
                                                            False)[0])

    module = jb.nn.LSTM(k, dtype=dtype)
    params = fnn.RNN(fnn.OptimizedLSTMCell(k)).init(jax.random.key(2), x)
    step = jax.jit(jax.grad(lambda p, x, dy: jnp.sum(module.apply(p, x).astype(jnp.float32) * dy),
                            argnums=(0, 1)))

    f = 2.0 * T * n * (c + k) * 4 * k  # one forward's multiply work
    return {"fwd": (fwd, (x, wi_k, wh_k, b, c0, h0), f),
            "fwd+save": (fwd_save, (x, wi_k, wh_k, b, c0, h0), f),
            "bptt": (bptt, bptt_args, f * k / (c + k)),
            "dx": (dx, (da2, wi_k), f * c / (c + k)),
            "upd": (upd, (xh2, da2), f),
            "step": (step, (params, x, dy.astype(jnp.float32)), 3 * f)}


def faults_per_call(fn, args, calls=3):
    common.block(fn(*args))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        common.block(fn(*args))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def main(argv=None):
    p = common.arg_parser(__doc__, 7, 0.2)
    p.add_argument("--n", type=int, default=168)
    p.add_argument("--c", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16

    print(f"cpu {common.machine().get('cpu', '?')}; kernel ISA {jb.isa()}; {args.dtype} "
          f"T={T} N={args.n} C=K={args.c}", flush=True)
    ps = passes(args.n, args.c, dtype)
    samples = common.interleaved({k: v[0] for k, v in ps.items()}, {k: v[1] for k, v in ps.items()},
                                 repeats=args.repeats, min_time=args.min_time)
    print("| pass | ms (median) | ms range | GFLOP/s | minor faults per call |")
    print("|---|---|---|---|---|")
    for name, (fn, fargs, flops) in ps.items():
        s = samples[name]
        med = statistics.median(s)
        print(f"| {name} | {1e3 * med:.1f} | {1e3 * min(s):.1f}-{1e3 * max(s):.1f} | "
              f"{flops / med / 1e9:.0f} | {faults_per_call(fn, fargs):.0f} |")
    parts = sum(statistics.median(samples[k]) for k in ("fwd+save", "bptt", "dx", "upd"))
    print(f"fwd+save + bptt + dx + upd = {1e3 * parts:.1f} ms; the step takes "
          f"{1e3 * statistics.median(samples['step']):.1f} ms")


if __name__ == "__main__":
    main()
