"""The process's heap, tuned for training steps: ``jb.reuse_freed_memory()``.

XLA's CPU runtime allocates a jitted step's buffers with ``malloc`` on every call. glibc
serves blocks above its mmap threshold (at most 32 MiB) with fresh ``mmap`` pages and gives
them back on ``free``, so every step page-faults and zero-fills its large buffers again: an
LSTM training step over T = 50, N = 168, C = K = 512 allocates ~250 MiB of them (the saved
gates alone are 69 MiB), and the kernel's page-fault work was 20 % of the step's CPU time
(measured with ``perf``, AMD EPYC Zen 4). Serving every block from the heap and keeping
freed memory in the process makes the next step reuse the same warm pages.

This is a process-wide setting of the C library (``mallopt``), so it is opt-in: the
training harness and the benchmarks call it at start (for every contender alike); an
application can call it once, before its first step. The process then keeps its peak heap
size until it exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def reuse_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    Returns True when the setting took effect; False where the C library is not glibc (the
    call then changes nothing).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # No mmap for large blocks (they come from the heap, whose freed pages stay mapped), and
    # never trim the heap's top (2 GiB - 1: the largest value the int parameter takes).
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
