"""How fast one core copies operands that are not in its own caches: numpy copies of
256 KiB chunks taken round-robin from a 64 MiB buffer (beyond both L2s, within this
machine's L3), one thread. Reports GB/s read (median and the spread over repeats).

    python bench/bandwidth.py [--repeats 9]

The BRGEMM benchmark's operands come from here: its jitted functions hold 8 calls on
distinct operands, several MB in all.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

CHUNK = 256 * 1024
POOL = 64 * 1024 * 1024


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    pool = np.ones(POOL, np.uint8)
    dst = np.empty(CHUNK, np.uint8)
    chunks = POOL // CHUNK
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for i in range(chunks):  # every chunk once: nothing is reused from L2
            np.copyto(dst, pool[i * CHUNK:(i + 1) * CHUNK])
        rates.append(POOL / (time.perf_counter() - t0) / 1e9)
    print(f"one core, 256 KiB copies from a 64 MiB pool: median {statistics.median(rates):.1f} GB/s "
          f"(min {min(rates):.1f}, max {max(rates):.1f})")


if __name__ == "__main__":
    main()
