"""The hindsight oracle on SmolLM2, two ways, in one run: on the whole rows
(``oracle_priorities``: a forward over context + tail) against from the shared context prefill
(``prefill_oracle_priorities``: the long-context table's path since 2026-12-03, only the tail
runs again).

    python bench/oracle_speed.py [--batch 8] [--length 2048] [--tail 50] [--repeats 2]

Random token ids: ``--length`` context tokens and ``--tail`` question + answer tokens per row,
``kind="mean"``, ``window=32``, the runner's cache length ``bucket(length + tail) + 32``.
Prints the median seconds of ``--repeats`` calls after the compile (the shared prefill, paid
once per batch for every policy, timed apart) and the largest difference of the priorities.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    import kvjax
    from kvjax.evaluation.oracle import oracle_priorities, prefill_oracle_priorities
    from kvjax.eviction.shared_prefill import prefill_context
    from kvjax.real_model import ensure_model
    from kvjax.sampling import bucket

    model = kvjax.load_hf(ensure_model())
    rng = np.random.RandomState(0)
    B, n, a = args.batch, args.length, args.tail
    ctx = rng.randint(100, 40000, (B, n)).tolist()
    tails = rng.randint(100, 40000, (B, a)).tolist()
    T = bucket(n + a) + 32
    whole = np.zeros((B, T), np.int32)
    whole[:, : n + a] = np.concatenate([np.asarray(ctx), np.asarray(tails)], axis=1)
    lengths = np.full(B, n + a, np.int32)

    def prefill():
        return prefill_context(model, ctx, cache_len=T, keep_queries=True)

    pre = jax.block_until_ready(prefill())
    old = np.asarray(oracle_priorities(model, whole, 32, lengths_B=lengths))                 # compiles
    new = np.asarray(prefill_oracle_priorities(model, pre, tails, 32))
    t_pre = _median(lambda: jax.block_until_ready(prefill()), args.repeats)
    t_old = _median(lambda: np.asarray(oracle_priorities(model, whole, 32, lengths_B=lengths)), args.repeats)
    t_new = _median(lambda: np.asarray(prefill_oracle_priorities(model, pre, tails, 32)), args.repeats)
    print(f"B={B}, context {n} + tail {a} tokens, T={T}")
    print(f"oracle on the whole rows          {t_old:7.2f} s")
    print(f"oracle from the shared prefill    {t_new:7.2f} s   ({t_old / t_new:.2f}x faster)")
    print(f"the shared prefill itself         {t_pre:7.2f} s   (paid once per batch for every policy)")
    finite = (old > -1e5) & (new > -1e5)
    print(f"largest difference of the priorities {np.max(np.abs(old - new)[finite]):.2e}; "
          f"same filler slots: {bool(np.array_equal(old > -1e5, new > -1e5))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
