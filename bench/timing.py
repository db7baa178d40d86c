"""Shared timing for the bench scripts: median wall time after one compile/warm-up run."""

from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after one warm-up (compile) run."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)
