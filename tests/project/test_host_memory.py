"""release_free_memory gives the freed pages of the C heap back: resident memory drops."""

import os
import platform
import subprocess
import sys

import pytest

# 400 MB in 64 KiB chunks (below glibc's mmap threshold: they live in the heap), all freed but
# the last, which pins the heap's top so that free() alone cannot shrink it.
PROBE = """
import ctypes
from kvjax.host_memory import release_free_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
chunks = []
for _ in range(6400):
    p = libc.malloc(65536)
    ctypes.memset(p, 1, 65536)           # touch: the pages become resident
    chunks.append(p)
for p in chunks[:-1]:
    libc.free(p)
before = rss()
ok = release_free_memory()
print(before, rss(), ok)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="reads /proc and glibc's malloc_trim")
def test_release_free_memory_returns_freed_heap_pages():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    before, after, ok = int(out[0]), int(out[1]), out[2] == "True"
    assert ok
    assert before - after > 300, f"resident {before} MB before the trim, {after} MB after: not given back"

