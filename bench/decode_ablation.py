"""Where a bounded decode step's time goes, on the decode benchmark's model (eval.py bench) or
any HF folder (``--model``).

    python bench/decode_ablation.py --batch 8 --length 4096 --budget 2048
    python bench/decode_ablation.py --model ~/.cache/kvjax/models/smollm2-135m-instruct --length 8192

Times, side by side in one run (each case in its own process, medians of ``--repeats``):
dense at ``--length``; dense at ``--budget`` (the same bytes of cache the bounded step reads,
no bookkeeping: the bounded step's floor); StreamingLLM (ring only: the slot placement with
no long-range ranking); K-norm (static priorities: placement and ranking, a trivial score);
KVpop with an mLSTM scorer (the scorer's per-step update on top). Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", help="an HF folder (SmolLM2: `make real-model`); default: the benchmark's model")
    ap.add_argument("--out", default="runs/decode-ablation.json")
    args = ap.parse_args(argv)

    from kvjax.evaluation import decode_bench as db

    load = os.getloadavg()
    if args.model and not (Path(args.model).expanduser() / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there (an HF folder is needed)")
    model = (Path(args.model).expanduser() if args.model
             else db.make_bench_model(Path(tempfile.gettempdir()) / "kvjax-bench-model"))
    cases = [("kvjax-dense", args.length, "dense at the context length"),
             ("kvjax-dense", args.budget, "dense at the budget (same cache bytes, no bookkeeping)"),
             ("kvjax-streaming_llm", args.length, "bounded, StreamingLLM (placement only)"),
             ("kvjax-knorm", args.length, "bounded, K-norm (placement + ranking)"),
             ("kvjax-kvpop", args.length, "bounded, KVpop mLSTM (+ scorer update)")]
    bw = db.copy_bandwidth()
    rows = []
    for impl, length, what in cases:
        spec = {"impl": impl, "model": str(model), "length": length, "batch": args.batch, "steps": args.steps,
                "repeats": args.repeats, "budget": args.budget}
        row = db.with_bandwidth(db.run_isolated(spec), bw)
        row["what"] = what
        rows.append(row)
        ms = f"{row['latency_s'] * 1e3:.2f}" if "latency_s" in row else f"failed: {row.get('error')}"
        print(f"{what:<58} {ms} ms/step", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"load_at_start": load, "copy_bandwidth": bw, "args": vars(args),
                                          "rows": rows}, indent=2))
    print(f"load average at start {load[0]:.2f}; copy bandwidth {bw / 1e9:.1f} GB/s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
