"""Generation throughput of SmolLM2-135M-Instruct: kvjax.generate vs transformers, side by side.

    python bench/real_model_speed.py --batches 1 8 --new 128 --out runs/real-model-speed.json

One chat prompt (~40 tokens) repeated ``batch`` times, ``--new`` new tokens with EOS off,
fp32; kvjax's compile is timed apart (first call), then medians of ``--repeats`` calls.
Run it on an idle machine (it prints the load average it started with).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default="runs/real-model-speed.json")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    import transformers

    import kvjax
    from kvjax.real_model import ensure_model

    load = os.getloadavg()
    folder = ensure_model()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = kvjax.load_hf(folder)
    ids = kvjax.text.encode_prompts(tok, ["Explain step by step how to add 17 and 25, then check the result."])[0]
    rows = []
    for B in args.batches:
        prompt = [ids] * B
        t = time.perf_counter()
        np.asarray(kvjax.generate(model, prompt, args.new, eos_token_id=[]))
        first = time.perf_counter() - t
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            np.asarray(kvjax.generate(model, prompt, args.new, eos_token_id=[]))
            times.append(time.perf_counter() - t)
        row = {"batch": B, "prompt_len": len(ids), "new_tokens": args.new, "kvjax_first_call_s": round(first, 2),
               "kvjax_s": statistics.median(times), "kvjax_tokens_per_s": B * args.new / statistics.median(times)}
        if not args.no_transformers:
            ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            x = torch.tensor([ids] * B)
            ht = []
            with torch.no_grad():
                ref.generate(x, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=2)
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new,
                                 min_new_tokens=args.new, do_sample=False, pad_token_id=2)
                    ht.append(time.perf_counter() - t)
            row.update(transformers_s=statistics.median(ht),
                       transformers_tokens_per_s=B * args.new / statistics.median(ht))
            row["kvjax_vs_transformers"] = row["transformers_s"] / row["kvjax_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"load_average_at_start": load, "cores": os.cpu_count(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("| batch | kvjax tokens/s | transformers tokens/s | kvjax / transformers | kvjax first call s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['kvjax_tokens_per_s']:.1f} | {r.get('transformers_tokens_per_s', 0):.1f} | "
              f"{r.get('kvjax_vs_transformers', 0):.2f}x | {r['kvjax_first_call_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
