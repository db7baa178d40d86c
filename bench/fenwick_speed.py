"""Speed of the keep-rule cutoffs: ``python bench/fenwick_speed.py [--repeats 5]``.

Times, after compilation and as the median of ``--repeats`` runs, for 8 heads:
``fenwick_cutoffs`` (ranks + parallel lifting), its two parts (``token_ranks``,
``cutoffs_from_ranks``), Algorithm 2 step by step (``fenwick_cutoffs_sequential``)
and the NumPy ``naive_cutoffs`` at the sizes each can do. Budget: s = 4, w = 64,
k = S / 8. The load average is printed because the figures depend on it.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from timing import median_seconds

from kvjax.eviction.fenwick import (
    cutoffs_from_ranks,
    fenwick_cutoffs,
    fenwick_cutoffs_sequential,
    naive_cutoffs,
    token_ranks,
)

HEADS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--sequential-max", type=int, default=32768, help="largest S for the step-by-step scan")
    parser.add_argument("--naive-size", type=int, default=2048, help="S for the NumPy reference (one head, scaled)")
    args = parser.parse_args()

    print(f"devices: {jax.devices()}  load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'S':>7} {'method':<28} {'seconds':>9} {'ns/token':>9}")
    for S in args.sizes:
        priority_HS = np.random.default_rng(S).normal(size=(HEADS, S)).astype(np.float32)
        budget = dict(sinks=4, window=64, topk=S // 8)
        rank_HS = token_ranks(priority_HS)
        runs = {
            "fenwick_cutoffs (total)": lambda: fenwick_cutoffs(priority_HS, **budget),
            "  token_ranks": lambda: token_ranks(priority_HS),
            "  cutoffs_from_ranks": lambda: cutoffs_from_ranks(rank_HS, **budget),
        }
        if S <= args.sequential_max:
            runs["fenwick_cutoffs_sequential"] = lambda: fenwick_cutoffs_sequential(priority_HS, **budget)
        for name, fn in runs.items():
            seconds = median_seconds(fn, args.repeats)
            print(f"{S:>7} {name:<28} {seconds:>9.4f} {seconds / (HEADS * S) * 1e9:>9.1f}", flush=True)

    S = args.naive_size
    priority_S = np.random.default_rng(0).normal(size=S).astype(np.float32)
    start = time.perf_counter()
    naive_cutoffs(priority_S, sinks=4, window=64, topk=S // 8)
    seconds = (time.perf_counter() - start) * HEADS
    print(f"{S:>7} {'naive_cutoffs (1 head x 8)':<28} {seconds:>9.4f} {seconds / (HEADS * S) * 1e9:>9.1f}")


if __name__ == "__main__":
    main()
