"""The hindsight oracle's forward on SmolLM2: query blocks (``prefill=True``, as shipped) against
one ``S x S`` attention a layer (as before 2026-12-03), in one run.

    python bench/oracle_speed.py [--batch 2] [--length 2080] [--repeats 2]

Random token ids, ``kvjax.evaluation.oracle.oracle_priorities(kind="mean", window=32)``;
median seconds of ``--repeats`` calls after the compile, and the largest difference of the
two priorities.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=2080)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    import numpy as np

    import kvjax
    from kvjax.evaluation import oracle
    from kvjax.models.attention import dense_attention
    from kvjax.real_model import ensure_model

    model = kvjax.load_hf(ensure_model())
    tokens = np.random.RandomState(0).randint(100, 40000, (args.batch, args.length)).astype(np.int32)
    out = {}
    variants = {"S x S a layer": lambda *a, **kw: dense_attention(*a, **{**kw, "prefill": False}),
                "query blocks": dense_attention}
    for name, attend in variants.items():
        oracle.dense_attention = attend          # read when _oracle is traced
        oracle._oracle.clear_cache()
        out[name] = np.asarray(oracle.oracle_priorities(model, tokens, 32))        # compile
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            np.asarray(oracle.oracle_priorities(model, tokens, 32))
            times.append(time.perf_counter() - t0)
        print(f"{name:<14} {statistics.median(times):7.2f} s  (B={args.batch}, S={args.length})", flush=True)
    a, b = out.values()
    finite = (a > -1e5) & (b > -1e5)
    print(f"largest difference of the priorities {np.max(np.abs(a - b)[finite]):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
