"""jb.reuse_freed_memory(): large blocks freed by one step are reused warm by the next."""

import platform
import subprocess
import sys

import pytest

# In a fresh process (the setting is process-wide): malloc, touch and free a 64 MiB block,
# then count the page faults of doing it again.
_PROBE = r"""
import ctypes, resource, sys
import jax_brgemm as jb
took = jb.reuse_freed_memory() if sys.argv[1] == "on" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 64 << 20
def cycle():
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")


def _faults(mode):
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    took, faults = out.stdout.split()
    return took, int(faults)


@glibc
def test_a_freed_large_block_comes_back_without_page_faults():
    took, warm = _faults("on")
    _, cold = _faults("off")
    assert took == "True"
    # 64 MiB is 16384 pages of 4 KiB (or 32 huge pages): glibc's default mmaps it afresh.
    assert cold >= 32, cold
    assert warm * 8 < cold, (warm, cold)
