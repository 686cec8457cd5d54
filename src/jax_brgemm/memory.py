"""The process's heap, tuned for training steps: ``jb.reuse_freed_memory()``.

XLA's CPU runtime allocates a jitted step's buffers with ``malloc`` on every call. glibc
serves blocks above its mmap threshold (at most 32 MiB) with fresh ``mmap`` pages and gives
them back on ``free``, so every step page-faults and zero-fills its large buffers again: an
LSTM training step over T = 50, N = 168, C = K = 512 allocates ~250 MiB of them (the saved
gates alone are 69 MiB), and the kernel's page-fault work was 20 % of the step's CPU time
(measured with ``perf``, AMD EPYC Zen 4). Serving every block from the heap and keeping
freed memory in the process makes the next step reuse the same warm pages.

XLA runs a step's thunks on its pool threads too, and glibc gives those threads their own
arenas: heaps of at most 64 MiB, which map a larger block afresh whatever the settings
above, and which glibc frees back when they empty. One arena for the whole process keeps
those blocks warm as well: a bf16 LSTM training step (T = 50, N = 168, C = K = 256) whose
loss gradient arrived in fp32 page-faulted ~33,000 times a step without it, and took 150-190
ms instead of 95-120 ms.

This is a process-wide setting of the C library (``mallopt``), so it is opt-in: the
training harness and the benchmarks call it at start (for every contender alike); an
application calls it once, before its first JAX computation (a thread that has already
allocated keeps its own arena). The process then keeps its peak heap size until it exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


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
    # No mmap for large blocks (they come from the heap, whose freed pages stay mapped), never
    # trim the heap's top (2 GiB - 1: the largest value the int parameter takes), and one
    # arena: threads that have not allocated yet share the main heap.
    return (bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
            and bool(mallopt(_M_ARENA_MAX, 1)))
