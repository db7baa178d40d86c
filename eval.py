#!/usr/bin/env python
"""Evaluate with kvjax: ``python eval.py --config configs/X.yaml [--set key=value ...]``.

Mode ``quality``: for each compression ratio and policy, teacher-forced accuracy per token
category (lookup near / far, compute) and KL to the dense model on held-out testbed
problems, plus answer accuracy under free generation. Writes ``results.json`` and
``results.md`` under ``out_dir``.

Mode ``bench`` (``--set mode=bench``): jitted decode latency, tokens/s, KV-cache bytes and
peak memory at each of ``bench_lengths`` and ``bench_batches`` for kvjax's dense cache,
KVpop's bounded cache (``bench_budget``) and ``transformers`` with the same weights, plus
the measured copy bandwidth; writes ``results.json``, ``results.md`` and
``decode_bench.png``. On a GPU/TPU: ``--set bench_preset=qwen3-8b
--set bench_lengths=[4096,16384,65536,131072] --set bench_transformers=false``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _markdown(rows: list[dict]) -> str:
    cols = ["compression", "policy", "budget", "lookup_far", "lookup_near", "compute", "graded", "kl", "answer",
            "answer_rel"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def run_quality(cfg) -> dict:
    import kvjax
    from kvjax.data import TestbedConfig
    from kvjax.evaluation.budgets import budget_for
    from kvjax.evaluation.quality import teacher_forced_quality

    model = kvjax.load_hf(cfg.model)
    tb = TestbedConfig(**cfg.testbed)
    rows, dense_answer = [], None
    for comp in cfg.compressions:
        ev = budget_for(tb.length, comp)
        print(f"compression {comp:.0%}: budget {ev.budget} = {ev.sinks} sinks + {ev.window} window + {ev.topk} top-k")
        res = teacher_forced_quality(model, tb, list(cfg.policies), ev, cfg.num_problems, tb.length,
                                     cfg.batch_size, cfg.split)
        for name in cfg.policies:
            row = {"compression": comp, "policy": name, "budget": "dense" if name == "dense" else ev.budget,
                   **res[name]}
            if cfg.answers:
                from kvjax.evaluation.quality import answer_policy

                row["answer"] = answer_policy(model, tb, name, ev, cfg.num_problems, tb.length, cfg.batch_size,
                                              cfg.split)
                if name == "dense":
                    dense_answer = row["answer"]
                if dense_answer:
                    row["answer_rel"] = row["answer"] / dense_answer
            rows.append(row)
            print(_markdown([row]).splitlines()[-1])
    return {"rows": rows}


def run_bench(cfg) -> dict:
    import jax

    from kvjax.evaluation import decode_bench as db

    out = Path(cfg.out_dir)
    model_dir = db.make_bench_model(out / ("bench-model" if cfg.bench_preset is None else
                                           f"bench-model-{cfg.bench_preset}"), cfg.bench_preset)
    bandwidth = db.copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    impls = ["kvjax-dense", "kvjax-kvpop"] + (["transformers-dense"] if cfg.bench_transformers else [])
    rows = []
    for batch in cfg.bench_batches:
        for length in cfg.bench_lengths:
            for impl in impls:
                spec = {"impl": impl, "model": str(model_dir), "length": length, "batch": batch,
                        "steps": cfg.bench_steps, "repeats": cfg.bench_repeats, "budget": cfg.bench_budget}
                rows.append(db.with_bandwidth(db.run_isolated(spec), bandwidth))
                print(db.markdown(rows[-1:]).splitlines()[-1], flush=True)
    db.plot(rows, out / "decode_bench.png")
    return {"rows": rows, "copy_bandwidth_bytes_per_s": bandwidth, "device": jax.devices()[0].device_kind,
            "markdown": db.markdown(rows), "plot": str(out / "decode_bench.png")}


def main(argv=None) -> int:
    from kvjax.configio import cli_config, to_dict
    from kvjax.evaluation.config import EvalConfig

    cfg, _ = cli_config(EvalConfig, "eval.py", __doc__, argv)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = run_quality(cfg) if cfg.mode == "quality" else run_bench(cfg)
    result.update(config=to_dict(cfg), wall_s=time.time() - t0, command=" ".join(["python", "eval.py", *sys.argv[1:]]))
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(_markdown(result["rows"]) if cfg.mode == "quality" else result["markdown"])
    print(f"wrote {out / 'results.json'} and {out / 'results.md'} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
