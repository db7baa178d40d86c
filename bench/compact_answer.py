"""A prefill-compressed policy's answering time, every slot read against the kept slots only.

    python bench/compact_answer.py --length 4096 --batch 4 --compressions 0.75 0.88

One dense context pass over RULER-style problems (:mod:`kvjax.longctx.tasks`, the tasks in
turn), K-norm compresses it, then :func:`kvjax.eviction.shared_prefill.answer` feeds the
question and decodes 32 tokens (no EOS stop) from a :class:`~kvjax.cache.CompactCache` of
``M`` context slots (the kept count, bucketed) and of all ``T`` slots (what a visibility mask
over the dense cache reads). The median of ``--repeats`` calls after one warm-up; run it on an
idle machine (it prints the load average it started with).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--compressions", type=float, nargs="+", default=[0.75, 0.88])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    import numpy as np
    import transformers

    import kvjax
    from bench.timing import median_seconds
    from kvjax.cache.compressed import compact, kept_context
    from kvjax.eviction.prompt_compressed import prompt_compressed
    from kvjax.eviction.shared_prefill import answer, compress, prefill_context
    from kvjax.longctx.run import LongCtxConfig, budget
    from kvjax.longctx.tasks import TASKS, Generator, prompt_ids
    from kvjax.real_model import ensure_model
    from kvjax.sampling import bucket

    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    folder = ensure_model()
    model, tok = kvjax.load_hf(folder), transformers.AutoTokenizer.from_pretrained(folder)
    cfg, gen, tasks = LongCtxConfig(lengths=[args.length]), Generator(tok), list(TASKS)
    parts = [prompt_ids(tok, gen.problem(tasks[i % len(tasks)], args.length, i, 0)) for i in range(args.batch)]
    context = np.asarray([len(c) for c, _ in parts])
    questions = [q for _, q in parts]
    S = max(len(c) + len(q) for c, q in parts)
    pre = prefill_context(model, [c for c, _ in parts], cache_len=bucket(S) + bucket(32), keep_queries=False)
    extra = bucket(max(map(len, questions))) + bucket(32)
    T = pre.dense.k[0].shape[2]
    print("| compression | every slot read, s | compacted, s | slots read |\n|---|---|---|---|")
    for comp in args.compressions:
        policy = prompt_compressed(kvjax.make_policy("knorm", budget(cfg, args.length, comp)), comp, context)
        cache = compress(policy, model, pre)
        M = min(bucket(kept_context(cache, context)), T - extra)
        sec = {m: median_seconds(lambda m=m: answer(model, compact(cache, context, extra=extra, slots=m), questions,
                                                    context, 32, eos_ids=[]), args.repeats) for m in (T - extra, M)}
        print(f"| {comp:.0%} | {sec[T - extra]:.2f} | {sec[M]:.2f} | {M:,} of {T - extra:,} |")


if __name__ == "__main__":
    main()
