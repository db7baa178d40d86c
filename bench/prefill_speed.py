"""Prompt (prefill) throughput of SmolLM2-135M-Instruct in kvjax: dense, one new token.

    python bench/prefill_speed.py --cases 8x1024 8x2048 2x4096 --out runs/prefill-speed.json

Random token ids (fixed seed), ``kvjax.generate(..., max_new_tokens=1)``: the prompt's forward
plus one logits row. fp32; the first call (compile) is timed apart, then the median of
``--repeats`` calls. Run it on an idle machine (it prints the load average it started with).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _case(text: str) -> tuple[int, int]:
    try:
        b, s = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is BATCHxLENGTH (e.g. 8x1024), got {text!r}") from None
    if b < 1 or s < 2:
        raise argparse.ArgumentTypeError(f"batch must be >= 1 and length >= 2, got {text!r}")
    return b, s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=_case, nargs="+", default=[(8, 1024), (8, 2048), (2, 4096)])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/prefill-speed.json")
    args = ap.parse_args(argv)

    import numpy as np

    import kvjax
    from bench.timing import median_seconds
    from kvjax.real_model import ensure_model

    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f}", flush=True)
    model = kvjax.load_hf(ensure_model())
    rows = []
    for batch, length in args.cases:
        tokens = np.random.default_rng(0).integers(100, 40000, (batch, length)).astype(np.int32)
        t0 = time.perf_counter()
        kvjax.generate(model, tokens, 1).block_until_ready()
        first = time.perf_counter() - t0
        sec = median_seconds(lambda: kvjax.generate(model, tokens, 1), args.repeats)
        rows.append({"batch": batch, "length": length, "seconds": sec, "first_call": first,
                     "tokens_per_s": batch * length / sec})
        print(f"{batch} x {length}: {sec:.2f} s ({batch * length / sec:.0f} tokens/s; first call {first:.1f} s)",
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"load_at_start": load[0], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
