"""H2O's prefill statistic (every query row's attention, summed per key): all rows at once
(``[B, K, G, S, S]``), blocks of 256 rows over every key, and blocks of 128 rows over the keys
up to the block's end (``columnwise``, as shipped for H2O since 2026-12-03), in one run
(:func:`kvjax.eviction.attention.statistic_scores`).

    python bench/statistic_speed.py [--batch 4] [--length 2048] [--repeats 3]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64), random queries and
keys, one layer; median seconds of ``--repeats`` calls after the compile, both in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.eviction.attention import statistic_probs, statistic_scores
    from kvjax.eviction.config import EvictionConfig
    from kvjax.eviction.policies import make_policy

    B, S = args.batch, args.length
    rs = np.random.RandomState(0)
    q = jnp.asarray(rs.randn(B, S, 9, 64), jnp.float32)
    k = jnp.asarray(rs.randn(B, S, 3, 64), jnp.float32)
    lengths = jnp.asarray(rs.randint(S * 7 // 8, S + 1, B), jnp.int32)
    h2o = make_policy("h2o", EvictionConfig())

    @jax.jit
    def all_rows(q, k, lengths):
        probs, qpos = statistic_probs(q, k, lengths, None)
        return h2o.prefill_scores(probs, lengths, qpos)

    @jax.jit
    def blocks(q, k, lengths):
        return statistic_scores(q, k, lengths, None, h2o.prefill_scores, block=256)

    @jax.jit
    def columnwise(q, k, lengths):
        return statistic_scores(q, k, lengths, None, h2o.prefill_scores, columnwise=True)

    out = {}
    for name, fn in (("all rows", all_rows), ("blocks of 256", blocks), ("columnwise 128", columnwise)):
        out[name] = np.asarray(fn(q, k, lengths))            # compile
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn(q, k, lengths).block_until_ready()
            times.append(time.perf_counter() - t0)
        print(f"{name:<16} {statistics.median(times):7.3f} s  (B={B}, S={S}, one layer)", flush=True)
    a = out["all rows"]
    for name in ("blocks of 256", "columnwise 128"):
        print(f"{name}: largest difference from all rows {np.max(np.abs(a - out[name])):.2e} "
              f"(scores up to {np.max(a):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
