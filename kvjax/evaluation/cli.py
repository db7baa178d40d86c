"""Evaluate with kvjax: ``python eval.py --config configs/X.yaml [--set key=value ...]``.

Mode ``quality``: for each length factor (``length_factors``: 1 = the testbed length, 2, 4),
compression ratio and policy, on ``num_problems`` held-out testbed problems: teacher-forced
accuracy per token category (lookup near / far, compute) and KL to the dense teacher,
answer accuracy under free generation, both relative to dense (the seeds' "Rel"), and
top-k retention recall against the oracle per layer and head; for learned policies, on the
first batch, the largest logit difference between the one-pass sparse path and the
token-by-token decode path (``decode_diff``, with ``decode_agree``). Learned policies come from
exported scorers (``scorers: {label: folder}``), each on its distilled student model
(``students: {label: hf_folder}``). Per-problem results are appended to
``out_dir/problems.jsonl.gz`` as they complete, so rerunning an interrupted command resumes it;
after a scorer or student is retrained, only that policy's results are recomputed.
Writes ``results.json``, ``results.md``, ``recall_heads.png`` and ``eviction_map.png``.

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


QUALITY_COLS = ["length", "compression", "policy", "budget", "window", "lookup_far", "lookup_near", "compute", "graded",
                "graded_rel", "copy_name", "copy_op", "answer_line", "kl", "answer", "answer_se", "answer_rel",
                "recall", "decode_diff", "problems"]


def _markdown(rows: list[dict], cols=QUALITY_COLS) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _fingerprint(cfg, model, scorers: dict, students: dict) -> tuple[dict, dict]:
    """What per-problem results depend on: ``(run, {label: its scorer / student files})``.
    A changed model invalidates every result, a changed scorer or student only its policy's.
    ``scorers`` / ``students``: ``{label: folder}`` of this run's policies (the store keeps the
    others' records)."""
    import hashlib

    from kvjax.export import config_hash

    def digest(path: Path) -> str:
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f.name.encode())
            h.update(f.read_bytes())
        return h.hexdigest()[:16]

    # quality-v2: the answer line's copies graded on their own (copy_name, copy_op, answer_line)
    run = {"metric": "quality-v2", "model": str(cfg.model), "model_config": config_hash(model.config),
           "weights": digest(Path(cfg.model)), "testbed": dict(cfg.testbed), "split": cfg.split,
           "answers": cfg.answers, "batch_size": cfg.batch_size}
    if cfg.window is not None:        # only when set: stores of the default budgets stay valid
        run["window"] = cfg.window
    policies: dict[str, dict] = {}
    for part, paths in (("scorer", scorers), ("student", students)):
        for label, path in sorted(paths.items()):
            policies.setdefault(label, {})[part] = [path, digest(Path(path))]
    return run, policies


def run_quality(cfg) -> dict:
    from tqdm.auto import tqdm

    import kvjax
    from kvjax.data import TestbedConfig, batch
    from kvjax.evaluation.budgets import budget_for
    from kvjax.evaluation.quality import BatchContext, aggregate, evaluate_policy
    from kvjax.evaluation.results_store import ResultsStore, load_learned, record_key

    model = kvjax.load_hf(cfg.model)
    # only what this run's policies use: a subset run needs no other policy's files
    scorer_dirs = {label: path for label, path in cfg.scorers.items() if label in cfg.policies}
    student_dirs = {label: path for label, path in cfg.students.items() if label in cfg.policies}
    learned, _ = load_learned(scorer_dirs, model)     # the store keeps this runner's own fingerprints
    students = {label: kvjax.load_hf(path) for label, path in student_dirs.items()}
    base = TestbedConfig(**cfg.testbed)
    run_fp, policy_fps = _fingerprint(cfg, model, scorer_dirs, student_dirs)
    for label in cfg.policies:           # a changed variant recomputes only its own rows
        if label in cfg.variants:
            policy_fps[label] = {"variant": cfg.variants[label]}
    store = ResultsStore(cfg.out_dir, run_fp, resume=cfg.resume, policies=policy_fps)
    for name, n in sorted(store.discarded.items()):
        print(f"discarding {n} stored results of {name}: its scorer or student files changed")
    policies = list(cfg.policies)

    def key(factor, comp, name, i):   # dense does not depend on the budget: evaluated once per length
        return record_key(factor, cfg.compressions[0] if name == "dense" else comp, name, i)

    def stored(factor, comp, name):   # this run's problems only (the folder may hold more)
        return [store.records[k] for i in range(cfg.num_problems) if (k := key(factor, comp, name, i)) in store.records]

    keys = {key(f, c, p, i) for f in cfg.length_factors for c in cfg.compressions for p in policies
            for i in range(cfg.num_problems)}
    total, done = len(keys), sum(k in store.records for k in keys)
    if done:
        print(f"resuming: {done} of {total} per-problem results already in {store.path}")
    bar = tqdm(total=total, initial=done, desc="quality", dynamic_ncols=True)
    for factor in cfg.length_factors:
        tb = base.scaled(factor) if factor > 1 else base
        for comp in cfg.compressions:
            ev = budget_for(tb.length, comp, window=cfg.window)
            bar.write(f"length {tb.length}, compression {comp:.0%}: budget {ev.budget} = {ev.sinks} sinks + "
                      f"{ev.window} window + {ev.topk} top-k")
            for start in range(0, cfg.num_problems, cfg.batch_size):
                idx = list(range(start, min(start + cfg.batch_size, cfg.num_problems)))
                todo = [p for p in policies if not store.has(key(factor, comp, p, i) for i in idx)]
                if not todo:
                    continue
                ctx = BatchContext(model, batch(tb, cfg.split, start, len(idx), tb.length), ev)
                for name in todo:
                    # learned policies: on the first batch at the first length, check that the
                    # one-pass sparse logits equal the token-by-token decode path's (real weights)
                    check = name in learned and start == 0 and factor == cfg.length_factors[0]
                    res = evaluate_policy(ctx, name, learned, answers=cfg.answers, students=students,
                                          path_check=check, variants=cfg.variants)
                    store.add([{"key": key(factor, comp, name, i), **r} for i, r in zip(idx, res)])
                    bar.update(len(idx))
                    agg = aggregate(stored(factor, comp, name))
                    bar.set_postfix(policy=name, graded=f"{agg['graded']:.3f}",
                                    answer=f"{agg.get('answer', float('nan')):.3f}")
    bar.close()
    store.close()   # the records stay readable; the folder is free for another evaluation
    rows = []
    for factor in cfg.length_factors:
        tb = base.scaled(factor) if factor > 1 else base
        dense = aggregate(stored(factor, cfg.compressions[0], "dense")) if "dense" in policies else None
        for comp in cfg.compressions:
            ev = budget_for(tb.length, comp, window=cfg.window)
            for name in policies:
                agg = aggregate(stored(factor, comp, name))
                row = {"length": tb.length, "compression": comp, "policy": name,
                       "budget": "dense" if name == "dense" else ev.budget,
                       "window": "" if name == "dense" else ev.window, **agg}
                if dense:
                    row["graded_rel"] = agg["graded"] / dense["graded"] if dense["graded"] else float("nan")
                    if "answer" in agg and dense.get("answer"):
                        row["answer_rel"] = agg["answer"] / dense["answer"]
                rows.append(row)
    result = {"rows": rows, "per_problem": str(store.path)}
    if cfg.plots:
        from kvjax.evaluation.quality_plots import plot_eviction_maps, plot_recall

        out = Path(cfg.out_dir)
        result["plots"] = [str(plot_recall(rows, out / "recall_heads.png"))]
        first = cfg.length_factors[0]
        tb = base.scaled(first) if first > 1 else base
        comp = cfg.compressions[0]
        kept = {p: store.records[record_key(first, comp, p, 0)]["kept"] for p in policies if p != "dense"}
        result["plots"].append(str(plot_eviction_maps(kept, batch(tb, cfg.split, 0, 1, tb.length),
                                                      out / "eviction_map.png", comp)))
    return result


def run_bench(cfg) -> dict:
    import jax

    from kvjax.evaluation import decode_bench as db

    out = Path(cfg.out_dir)
    if cfg.bench_model is not None:
        model_dir = Path(cfg.bench_model)
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"bench_model: {model_dir} is not a Hugging Face folder (no config.json)")
    else:
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
            "speedups": db.speedups(rows), "plot": str(out / "decode_bench.png"),
            "markdown": db.markdown(rows) + "\n" + db.speedup_markdown(rows)}


def main(argv=None) -> int:
    from kvjax.configio import cli_config, to_dict
    from kvjax.evaluation.config import EvalConfig

    cfg, _ = cli_config(EvalConfig, "eval.py", __doc__, argv, set_example="num_problems=16", examples=(
        'python eval.py --config configs/testbed-quality.yaml --set "policies=[dense,snapkv,dms]" '
        "--set num_problems=16 --set out_dir=runs/quality-try",))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        result = run_quality(cfg) if cfg.mode == "quality" else run_bench(cfg)
    except FileNotFoundError as e:
        print(f"eval.py: {e}", file=sys.stderr)
        return 1
    args = sys.argv[1:] if argv is None else list(argv)
    result.update(config=to_dict(cfg), wall_s=time.time() - t0, command=" ".join(["python", "eval.py", *args]))
    (out / "results.json").write_text(json.dumps(result, indent=2))
    table = _markdown(result["rows"]) if cfg.mode == "quality" else result["markdown"]
    (out / "results.md").write_text(table)
    print(table)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'} ({result['wall_s']:.0f} s)")
    return 0
