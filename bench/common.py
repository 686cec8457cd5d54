"""Shared benchmark plumbing: timing, the machine's peak, results files and charts.

Benchmarks are not tests: they measure, tests check. Every figure is a distribution over
repeated runs in one process (min / median / max), side by side with the stock baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import numpy as np

import jax_brgemm

# Every contender in a benchmark process runs on the same heap: large blocks reuse warm
# pages instead of being mmapped and faulted in again on every call (jax_brgemm.memory).
jax_brgemm.reuse_freed_memory()

RESULTS_ROOT = Path(__file__).resolve().parent / "results"


def cpuinfo() -> dict:
    """The first processor's block of /proc/cpuinfo (it describes them all), or {}."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_name() -> str:
    """This CPU as every figure names it: vendor, family, model, the kernel ISA and the
    model name, e.g. "AuthenticAMD family 25 model 17, avx512 (AMD EPYC 9R14 ...)"."""
    info = cpuinfo()
    return (f"{info.get('vendor_id', platform.machine())} family {info.get('cpu family', '?')} "
            f"model {info.get('model', '?')}, {jax_brgemm.isa()} ({info.get('model name', '?')}, "
            f"{os.cpu_count()} CPUs)")


def cpu_kind() -> str:
    """This CPU's kind (zen4, xeon-207-amx, ...), from /proc/cpuinfo: its results folder's
    name. Intel kinds carry the model: Xeons of one model name differ (DESIGN.md)."""
    info = cpuinfo()
    if not info:
        return platform.machine().lower() or "unknown"
    vendor, flags = info.get("vendor_id", ""), set(info.get("flags", "").split())
    family, model = int(info.get("cpu family", 0)), int(info.get("model", 0))
    if vendor == "AuthenticAMD":
        # Family 23 is Zen 1 / Zen+ (models below 0x30) and Zen 2; 25 is Zen 3 and Zen 4,
        # told apart by AVX-512; 26 is Zen 5.
        if family == 23:
            return "zen1" if model < 0x30 else "zen2"
        if family == 25:
            return "zen4" if "avx512f" in flags else "zen3"
        return "zen5" if family == 26 else f"amd-{family}-{model}"
    if vendor == "GenuineIntel":
        name = ("xeon" if "Xeon" in info.get("model name", "") else "intel") + f"-{model}"
        if "amx_bf16" in flags:
            return f"{name}-amx"
        return f"{name}-noamx" if "avx512f" in flags else f"{name}-avx2"
    return (vendor or platform.machine()).lower() or "unknown"


RESULTS = RESULTS_ROOT / cpu_kind()


def block(x):
    return jax.tree_util.tree_map(lambda v: v.block_until_ready() if hasattr(v, "block_until_ready") else v, x)


def time_jitted(fn, *args, repeats: int = 15, min_time: float = 0.05) -> list[float]:
    """Seconds per call of an already-jitted fn: `repeats` samples, each a loop of enough
    calls to last `min_time` (so timer and dispatch noise stay small)."""
    block(fn(*args))  # compile and warm up
    t0 = time.perf_counter()
    block(fn(*args))
    once = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(min_time / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        block(out)
        samples.append((time.perf_counter() - t0) / inner)
    return samples


def torch_or_none():
    """PyTorch with one thread per CPU, or None when it is not installed."""
    # torch's OpenMP threads spin after each call by default; sharing two cores with XLA's
    # pool (and whatever else runs) that spinning starves everyone, torch included.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    return torch


def under(accuracy, f):
    """f traced under jax.default_matmul_precision of a harness accuracy name (its products
    emulated from bfloat16 ones where jax_brgemm.precision.EMULATE is on)."""
    def traced(*args):
        with jax.default_matmul_precision(jax_brgemm.precision.HARNESS[accuracy]):
            return f(*args)
    return traced


def torch_one_bf16_product(torch, backend: str, f):
    """f with PyTorch's one-pass bf16 mode for float32 `backend` ("matmul" or "conv") work
    (oneDNN's; what it offers beside our "bf16"; a CPU without bf16 products computes float32
    either way)."""
    flags = getattr(torch.backends.mkldnn, backend)

    def call():
        flags.fp32_precision = "bf16"
        try:
            return f()
        finally:
            flags.fp32_precision = "none"
    return call


def stats(samples) -> dict:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def pair_ratios(samples: dict, ours: str, other: str) -> dict:
    """other's time / ours, round by round (interleaved samples of one round are pairs), so
    the machine's drift hits both alike: {"median", "min", "max"}."""
    return stats([b / a for a, b in zip(samples[ours], samples[other])])


def summarize(samples: dict, flops: float) -> dict:
    """Seconds and GFLOP/s (median and range) per contender, for a results row."""
    return {"seconds": {k: stats(v) for k, v in samples.items()},
            "gflops": {k: flops / statistics.median(v) / 1e9 for k, v in samples.items()},
            "gflops_range": {k: [flops / max(v) / 1e9, flops / min(v) / 1e9] for k, v in samples.items()}}


def arg_parser(doc: str, repeats: int, min_time: float | None = None) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring as help, --repeats and (when it times loops)
    --min-time with the script's defaults."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=repeats)
    if min_time is not None:
        p.add_argument("--min-time", type=float, default=min_time)
    return p


def interleaved(fns: dict, args: dict, repeats: int = 15, min_time: float = 0.05) -> dict:
    """Times several jitted functions round-robin, so that machine noise (other processes
    on these shared cores) hits every contender alike. Returns {name: [seconds per call]}."""
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name] += time_jitted(fn, *args[name], repeats=1, min_time=min_time)
    return samples


def measure_peak(seconds: float = 0.3, repeats: int = 7) -> dict:
    """The machine's arithmetic ceilings in GFLOP/s, measured now (jax_brgemm.peak_gflops)."""
    import jax_brgemm

    return jax_brgemm.peak_gflops(seconds, repeats)


def peak_table_head(peak: dict, keys: list[str], names: list[str], vs: str) -> list[str]:
    """A markdown table's first lines: the measured peaks, then columns for `keys`, each
    contender's GFLOP/s, % of peak and the ratios to `vs` (and to torch when it ran)."""
    torch = "torch" in names
    return [f"Measured peak: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s.", "",
            "| " + " | ".join(keys) + " | " + " | ".join(f"{n} GFLOP/s" for n in names) +
            f" | % of peak | vs {vs} |" + (" vs torch |" if torch else ""),
            "|" + "---|" * (len(keys) + len(names) + 2 + torch)]


def machine() -> dict:
    cpu = cpuinfo()
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "jax": jax.__version__, "cpus": os.cpu_count(), "cpu_kind": cpu_kind(),
            "vendor": cpu.get("vendor_id"), "family": cpu.get("cpu family"), "model": cpu.get("model")}
    try:
        import jax_brgemm
        info["jax_brgemm_isa"] = jax_brgemm.isa()
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"suite": name, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def with_earlier_rows(name: str, rows: list[dict], key, order) -> list[dict]:
    """``rows`` and, from the last ``name`` results file, the rows whose ``key`` was not measured
    this time (a run of some layers or models updates theirs), each stamped with the time it
    was measured; sorted by ``order`` (rows it gives None, no longer benchmarked, are dropped)."""
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    for r in rows:
        r.setdefault("measured", now)
    path = RESULTS / f"{name}.json"
    if path.exists():
        earlier = json.loads(path.read_text())
        done = {key(r) for r in rows}
        rows += [{**r, "measured": r.get("measured", earlier["date"])} for r in earlier["rows"] if key(r) not in done]
    return sorted((r for r in rows if order(r) is not None), key=order)


def plot_bars(name: str, labels: list[str], series: dict[str, list[float]], ylabel: str,
              title: str, hline: float | None = None, hline_label: str = "") -> Path:
    """Grouped bar chart: one group per label, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels) + 2), 4.2))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(labels))
    for i, (sname, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=sname)
    if hline is not None:
        ax.axhline(hline, color="black", linestyle="--", linewidth=1, label=hline_label)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
