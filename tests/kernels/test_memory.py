"""jb.reuse_freed_memory(): large blocks freed by one step are reused warm by the next."""

import platform
import subprocess
import sys

import pytest

# In a fresh process (the setting is process-wide): malloc, touch and free a block, then count
# the page faults of doing it again, on the main thread (64 MiB) and on a new thread (80 MiB:
# above the 64 MiB heaps of glibc's per-thread arenas, as XLA's pool threads allocate).
_PROBE = r"""
import ctypes, resource, sys, threading
import jax_brgemm as jb
took = jb.reuse_freed_memory() if sys.argv[1] == "on" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def faults(size):
    def cycle():
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(p)
    cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cycle()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
main = faults(64 << 20)
other = []
thread = threading.Thread(target=lambda: other.append(faults(80 << 20)))
thread.start()
thread.join()
print(took, main, other[0])
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")


def _faults(mode):
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    took, main, thread = out.stdout.split()
    return took, int(main), int(thread)


@glibc
def test_a_freed_large_block_comes_back_without_page_faults():
    took, warm, warm_thread = _faults("on")
    _, cold, cold_thread = _faults("off")
    assert took == "True"
    # 64 MiB is 16384 pages of 4 KiB (or 32 huge pages): glibc's default mmaps it afresh.
    assert cold >= 32, cold
    assert warm * 8 < cold, (warm, cold)
    # On a thread of its own too (without the one-arena setting this faults as often as cold).
    assert cold_thread >= 40, cold_thread
    assert warm_thread * 8 < cold_thread, (warm_thread, cold_thread)
