"""How fast the emulation splits float32 operands into their packed bfloat16 parts, against a
memcpy of the same block: one thread, calls of ``_jax_brgemm.split_block`` (the split, or the
copy, of one block many times over) timed alternately, medians per block.

    python bench/bench_split.py [--repeats 21]

A float32 product from 1, 3 or 6 bfloat16 products splits each operand into 1, 2 or 3 parts
(layers/common/emulation.h), written where the kernel reads them: VNNI pairs, as a weight
panel. Each row is one block: 256 x 128 (a panel block, in L2), 1024 x 1024 (in L3) and
4096 x 4096 (from memory), or a 4096 x 4096 weight split in 256 x 128 panel blocks, one after
the other into one block's buffer, as a pass splits it; row-major (the forward's w) or
transposed (the backward's w^T). Rates count the bytes read and written: 4 + 2 x parts per
value for the split, 8 for the copy. Writes bench/results/<cpu-kind>/split.json.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import common
import jax_brgemm as jb
from jax_brgemm import _jax_brgemm

# (rows, cols, block): block None splits the whole matrix as one block
BLOCKS = ((256, 128, None), (1024, 1024, None), (4096, 4096, None), (4096, 4096, (256, 128)))
PARTS = {1: 1, 3: 2, 6: 3}  # products -> parts of each operand


def seconds(src, out, products, trans, rounds, block):
    """Median seconds of one split (products > 0) or copy (0) of src, over `rounds` timed calls
    of a few ms each."""
    calls = max(1, int(1e6 // src.size))
    _jax_brgemm.split_block(src, out, products, trans, 1, *block)  # warm: out's pages touched
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        _jax_brgemm.split_block(src, out, products, trans, calls, *block)
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


def main(argv=None):
    args = common.arg_parser(__doc__, 21).parse_args(argv)
    print(f"CPU: {common.cpu_name()}; kernel ISA {jb.isa()}\n")
    print("| block | products | layout | split GB/s | memcpy GB/s | split / memcpy |\n|---|---|---|---|---|---|")
    rows = []
    for r, c, block in BLOCKS:
        repeats = args.repeats if r * c <= 1 << 20 else max(3, args.repeats // 4)
        name = f"{r} x {c}" + (f" in {block[0]} x {block[1]} blocks" if block else "")
        for products, parts in PARTS.items():
            for trans in (False, True):
                src = np.random.default_rng(0).standard_normal((c, r) if trans else (r, c), dtype=np.float32)
                out = np.empty(parts * (r + 1) // 2 * 2 * c * 2 + 4 * r * c, np.uint8)
                split = seconds(src, out, products, trans, repeats, block or (0, 0))
                copy = seconds(src, out, 0, trans, repeats, block or (0, 0))
                split_rate, copy_rate = (4 + 2 * parts) * r * c / split / 1e9, 8 * r * c / copy / 1e9
                rows.append({"rows": r, "cols": c, "block": block, "products": products, "transposed": trans,
                             "split_gbps": split_rate, "memcpy_gbps": copy_rate, "ratio": split_rate / copy_rate})
                print(f"| {name} | {products} | {'transposed' if trans else 'row-major'} | {split_rate:.1f} | "
                      f"{copy_rate:.1f} | {split_rate / copy_rate:.2f} |", flush=True)
    print("wrote", common.write_results("split", {"repeats": args.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
