"""Each policy's prefill compression against one dense prefill, side by side on SmolLM2 (real weights).

    python bench/prefill_cost.py --lengths 1024 2048 --batch 1 --repeats 3 \\
        --learned kvpop_mlp_recon=assets/smollm2-scorers/kvpop-mlp-recon

For each context length: the dense prefill of the context (``shared_prefill.prefill_context``,
what every policy pays) and each policy's compression of that cache (``shared_prefill.compress``:
KVzip's reconstruction pass and top-k; a scorer's priorities over every layer and head and its
top-k), each timed after a first (compiling) call, median of ``--repeats``, in one process and
one after the other on the same contexts. Prints ``(prefill + compression) / prefill``, the
factor a policy's prefill costs over a dense one. ``--budgets`` is the learned rows' budget rule
(KVzip's is ``global`` unless ``layer``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compression", type=float, default=0.75)
    ap.add_argument("--policies", nargs="*", default=["kvzip"], help="registered policies (default: kvzip)")
    ap.add_argument("--learned", nargs="*", default=[], metavar="LABEL=DIR", help="exported scorer folders")
    ap.add_argument("--budgets", default="global", choices=["uniform", "layer", "global"])
    args = ap.parse_args(argv)
    learned = dict(s.split("=", 1) for s in args.learned)

    import jax
    import numpy as np

    import kvjax
    from kvjax.eviction.config import kept_slots
    from kvjax.eviction.shared_prefill import compress, prefill_context
    from kvjax.real_model import ensure_model

    model = kvjax.load_hf(ensure_model())
    rs = np.random.RandomState(0)
    names = [*args.policies, *learned]
    print(f"load average {os.getloadavg()[0]:.2f}; batch {args.batch}; {args.compression:.0%} compression; "
          f"median of {args.repeats} after a first call")
    print("| context | dense prefill | " + " | ".join(f"{n} compression | {n} / dense" for n in names) + " |")
    print("|---|---|" + "---|---|" * len(names))
    for n in args.lengths:
        contexts = [rs.randint(100, 40000, n).tolist() for _ in range(args.batch)]
        lengths = [n] * args.batch
        ev = kvjax.EvictionConfig(4, 32, kept_slots(args.compression, n) - 36, prefill="compressed")
        policies = {name: kvjax.make_policy(name, ev) for name in args.policies}
        policies |= {lbl: kvjax.load_scorers(d, model=model, config=dataclasses.replace(ev, budgets=args.budgets))
                     for lbl, d in learned.items()}
        policies = {k: kvjax.prompt_compressed(p, args.compression, lengths) for k, p in policies.items()}

        def prefill():
            pre = prefill_context(model, contexts, cache_len=n, keep_queries=False)
            jax.block_until_ready(pre.dense.k)
            return pre

        def timed(f):
            t0 = time.perf_counter()
            out = f()
            jax.block_until_ready(jax.tree.leaves(out))
            return out, time.perf_counter() - t0

        pre = prefill()
        for p in policies.values():
            timed(lambda: compress(p, model, pre))                      # compile
        dense, comp = [], {k: [] for k in policies}
        for _ in range(args.repeats):
            pre, t = timed(prefill)
            dense.append(t)
            for k, p in policies.items():
                comp[k].append(timed(lambda: compress(p, model, pre))[1])
        d = statistics.median(dense)
        cells = " | ".join(f"{statistics.median(c):.3f} s | {(d + statistics.median(c)) / d:.2f}x" for c in comp.values())
        print(f"| {n} | {d:.3f} s | {cells} |")


if __name__ == "__main__":
    main()
