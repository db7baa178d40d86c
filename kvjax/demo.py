"""``make demo``: kvjax end to end on the shipped testbed teacher, in a few minutes on 2 CPU cores.

1. load the teacher (``assets/testbed-teacher``, a Hugging Face Qwen3 folder);
2. distil a KVpop mLSTM scorer into it for a few steps (``train.py``, mode ``distill_kvpop``);
3. export the scorer weights (``scorers.safetensors`` + ``scorer_config.json``);
4. the quality table at 75% compression: dense, StreamingLLM, H2O and the distilled KVpop;
5. a short jitted decode benchmark: dense vs KVpop's bounded cache vs ``transformers``;
6. where every table and plot went.

``python -m kvjax.demo [--out DIR] [--steps N] [--problems N] [--lengths 1024,4096]``.
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


def _banner(step: int, text: str) -> None:
    print(f"\n=== [{step}/6] {text}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvjax.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo", help="folder for everything the demo writes (default runs/demo)")
    ap.add_argument("--teacher", default=str(TEACHER), help="Hugging Face folder of the testbed teacher")
    ap.add_argument("--steps", type=int, default=200, help="KVpop distillation steps (default 200)")
    ap.add_argument("--problems", type=int, default=64, help="held-out problems in the quality table (default 64)")
    ap.add_argument("--lengths", default="1024,4096", help="decode-benchmark lengths (default 1024,4096)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    for sub in ("distill-kvpop", "scorers", "quality", "bench"):   # the demo's own folders: start afresh
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    import jax
    from flax import nnx

    sys.path.insert(0, str(ROOT))   # train.py and eval.py are the repository's entry points
    import kvjax

    _banner(1, f"the testbed teacher: {args.teacher}")
    teacher = kvjax.load_hf(args.teacher)
    c = teacher.config
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(teacher)))
    print(f"Qwen3, {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} query / {c.num_kv_heads} KV heads, "
          f"{n_params / 1e6:.2f} M parameters, vocabulary {c.vocab_size} words")

    _banner(2, f"KVpop distillation ({args.steps} steps, mLSTM scorer, 75% compression of 512-token traces)")
    import train as train_cli

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
    import eval as eval_cli

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
                        ("per-problem results (resumable)", quality / "problems.jsonl"),
                        ("decode benchmark table", bench / "results.md"),
                        ("decode latency / memory plot", bench / "decode_bench.png")]:
        print(f"  {label:<48} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
