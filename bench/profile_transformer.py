"""Where a Transformer training step spends its time: per-op wall time of the steps of
``bench_transformer.py`` (the BERT-base layer in plain flax.linen, post-LN, dropout 0.1, and
the 2-layer causal LM), stock and under ``jax_brgemm.accelerate()``, from a JAX profiler
trace.

    python bench/profile_transformer.py [--case bert] [--t 128] [--dtype float32] [--steps 5] [--top 25]

Every op of the compiled step (a custom call, an XLA fusion, dot, loop or copy) is named
after the module it belongs to (from the HLO metadata: ``MultiHeadDotProductAttention_0/
query``, ``Dense_1``, ``LayerNorm_0``, ``Dropout_1``, ...), the direction (``fwd``, or
``bwd`` for the transposed forward) and its kind (the custom call's target, or XLA's
``fusion`` / ``dot`` / ``while``, ...). An asynchronous custom call or dot lasts from its
start to its completion event. Prints, per implementation, the ms per step of the ``--top``
ops and the step split into groups: the FC passes, the attention passes, dropout (the keep
masks drawn and applied), LayerNorm, the activation, the loss, the embedding, and the rest
of XLA's fusions; and the sum of the ops against the step's wall time (the ops overlap when
asynchronous calls run beside XLA's ops).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_transformer  # noqa: E402
from profile_mlp import traced_ms  # noqa: E402

import jax_brgemm as jb  # noqa: E402

_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.-]+) = .*?\b(custom-call|fusion|dot|while|copy|scatter|gather|"
                          r"reduce|sort|transpose|convolution|call|select-and-scatter|dynamic-update-slice)\(")
_GROUPS = (("attention", r"jb_attention|Attention_\d+ \w+ (fusion|dot)"),
           ("FC passes", r"jb_fc|jb_dense|\bdot\b|(Dense_\d+|query|key|value|out) \w+ fusion"),
           ("dropout", r"Dropout|bernoulli|threefry"), ("LayerNorm", r"LayerNorm"),
           ("activation", r"gelu|relu|tanh|erf"), ("embedding", r"Embed|pos\b|scatter|gather"),
           ("loss", r"loss|log_softmax|take_along_axis"))


def op_labels(compiled_text: str, model: str) -> dict:
    """{instruction name: 'module direction kind'} for every op the trace can show."""
    labels = {}
    for line in compiled_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, kind = m.groups()
        target = re.search(r'custom_call_target="(\w+)"', line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        path = op_name.group(1) if op_name else ""
        module = re.search(model + r"\)*/([^/]+(?:/(?:query|key|value|out))?)", path)
        where = module.group(1) if module else ("loss" if path else "step")
        direction = "bwd" if "transpose(" in path else "fwd"
        what = target.group(1) if target else kind
        if re.search(r"bernoulli|threefry", path):
            what += " (rng)"
        labels[name] = f"{where} {direction} {what}"
    return labels


def group_of(label: str) -> str:
    for group, pattern in _GROUPS:
        if re.search(pattern, label):
            return group
    return "other XLA ops"


def step_and_args(case: str, t: int, dtype):
    """The jitted step (params, key) -> grads of bench_transformer's case, and its args."""
    rng = np.random.default_rng(t)
    if case == "bert":
        x = jnp.asarray(rng.standard_normal((bench_transformer.BATCH, t, 768)), dtype)
        params, step = bench_transformer.flax_step(bench_transformer.BertLayer(dtype), x,
                                                   lambda y: jnp.mean(y.astype(jnp.float32) ** 2))
        model = "BertLayer"
    else:
        tokens = jnp.asarray(rng.integers(0, 30000, (bench_transformer.BATCH, t)))
        xent = lambda logits: -jnp.mean(jnp.take_along_axis(  # noqa: E731
            jax.nn.log_softmax(logits), tokens[..., None], -1))
        params, step = bench_transformer.flax_step(bench_transformer.CausalLM(dtype), tokens, xent)
        model = "CausalLM"
    return jax.jit(step), (params, jax.random.key(2)), model


def report(name: str, per_op: dict, labels: dict, top: int) -> list[str]:
    step = per_op.pop("<step>")
    by_label, groups = collections.Counter(), collections.Counter()
    for op, ms in per_op.items():
        by_label[labels[op]] += ms
        groups[group_of(labels[op])] += ms
    lines = [f"## {name}: {step:.1f} ms per step (ops summed: {sum(by_label.values()):.1f} ms)", "",
             "| op | ms |", "|---|---|"]
    lines += [f"| {label} | {ms:.2f} |" for label, ms in by_label.most_common(top)]
    lines += ["", "| group | ms | % of the ops |", "|---|---|---|"]
    total = sum(groups.values())
    lines += [f"| {g} | {ms:.1f} | {100 * ms / total:.0f} |" for g, ms in groups.most_common()]
    return lines + [""]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=["bert", "lm"], default="bert")
    p.add_argument("--t", type=int, default=128, help="the sequence length (the LM's is 256)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    t = args.t if args.case == "bert" else 256
    print(f"# {args.case} T={t} {args.dtype}, {jb.isa()} kernels, {args.steps} steps\n")
    for impl in ("accelerate", "stock"):
        step, fargs, model = step_and_args(args.case, t, dtype)
        if impl == "accelerate":
            with jb.accelerate():
                labels = op_labels(step.lower(*fargs).compile().as_text(), model)
                per_op = traced_ms(step, fargs, args.steps, labels)
        else:
            labels = op_labels(step.lower(*fargs).compile().as_text(), model)
            per_op = traced_ms(step, fargs, args.steps, labels)
        print("\n".join(report(impl, per_op, labels, args.top)), flush=True)


if __name__ == "__main__":
    main()
