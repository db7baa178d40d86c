"""H2O's prefill statistic (every query row's attention, summed per key): all rows at once
(``[B, K, G, S, S]``) against blocks of rows (:func:`kvjax.eviction.attention.statistic_scores`).

    python bench/statistic_speed.py [--batch 4] [--length 2048] [--block 256] [--repeats 3]

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
    ap.add_argument("--block", type=int, default=256)
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
        return statistic_scores(q, k, lengths, None, h2o.prefill_scores, block=args.block)

    out = {}
    for name, fn in (("all rows", all_rows), (f"blocks of {args.block}", blocks)):
        out[name] = np.asarray(fn(q, k, lengths))            # compile
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn(q, k, lengths).block_until_ready()
            times.append(time.perf_counter() - t0)
        print(f"{name:<16} {statistics.median(times):7.3f} s  (B={B}, S={S}, one layer)", flush=True)
    a, b = out.values()
    print(f"largest difference {np.max(np.abs(a - b)):.2e} (scores up to {np.max(a):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
