"""Giving freed host memory back to the system during a long run.

XLA on the CPU allocates its buffers with ``malloc``; glibc keeps the pages of freed chunks
that sit below a live one, so a long run's resident memory creeps up with every batch of new
shapes although little of it is live. Measured on the long-context table's 4k worker
(``python -m kvjax.longctx``, batches of 4 x 4k tokens): 15.2 GB resident after six
batches, 7.5 GB after one ``malloc_trim(0)``. :func:`release_free_memory` is that call; the
runner makes it after every policy's run (0.14 s to give back 1 GB, 15 ms when little is free).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl). Under an
    allocator loaded with ``LD_PRELOAD`` (jemalloc, tcmalloc) the call is harmless and does nothing."""
    for name in (None, "c"):            # the process's own symbols (Linux), then the C library by name
        try:
            trim = ctypes.CDLL(name if name is None else ctypes.util.find_library(name)).malloc_trim
        except (OSError, AttributeError):
            continue
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return trim
    return None


def release_free_memory() -> bool:
    """Return the freed pages of the C heap to the system (``malloc_trim(0)``). Returns whether
    the C library could do it (False where it has no ``malloc_trim``); live data is untouched."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
