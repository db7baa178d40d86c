"""KVzip's prefill cost against one dense prefill, side by side on SmolLM2 (real weights).

    python bench/kvzip_cost.py --lengths 1024 2048 --batch 1 --repeats 3

For each context length: the dense prefill of the context (``shared_prefill.prefill_context``)
and KVzip's reconstruction pass over that cache (``kvzip.reconstruction_scores``), each timed
after a first (compiling) call, median of ``--repeats``; prints the ratio (prefill +
reconstruction) / prefill, the factor a KVzip prefill costs over a dense one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    import kvjax
    from kvjax.eviction.kvzip import repeat_prompts_for, reconstruction_scores
    from kvjax.eviction.shared_prefill import prefill_context
    from kvjax.real_model import ensure_model

    model = kvjax.load_hf(ensure_model())
    prompts = repeat_prompts_for(model)
    rs = np.random.RandomState(0)
    print(f"load average {os.getloadavg()[0]:.2f}; batch {args.batch}; median of {args.repeats} after a first call")
    print("| context | dense prefill | reconstruction | KVzip prefill / dense prefill |")
    print("|---|---|---|---|")
    for n in args.lengths:
        contexts = [rs.randint(100, 40000, n).tolist() for _ in range(args.batch)]

        def prefill():
            pre = prefill_context(model, contexts, cache_len=n, keep_queries=False)
            jax.block_until_ready(pre.dense.k)
            return pre

        pre = prefill()
        jax.block_until_ready(reconstruction_scores(model, pre.dense.k, pre.dense.v, contexts, prompts))
        dense, replay = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            pre = prefill()
            t1 = time.perf_counter()
            jax.block_until_ready(reconstruction_scores(model, pre.dense.k, pre.dense.v, contexts, prompts))
            t2 = time.perf_counter()
            dense.append(t1 - t0)
            replay.append(t2 - t1)
        d, r = statistics.median(dense), statistics.median(replay)
        print(f"| {n} | {d:.2f} s | {r:.2f} s | {(d + r) / d:.2f}x |")


if __name__ == "__main__":
    main()
