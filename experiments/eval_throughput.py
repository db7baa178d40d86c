"""Evaluation throughput, kvjax against kvpress 0.5.5: seconds per record on the same problems,
press for press, run one after the other in one invocation on one machine.

    python experiments/eval_throughput.py [--problems 8] [--compressions 0.75 0.88] \\
        [--methods dense streaming_llm snapkv tova knorm pyramidkv adakv keydiff kvzip] \\
        [--out runs/eval-throughput]
    make eval-throughput            # the same

Both sides answer the same tokenized problems (``python -m kvjax.longctx --export-problems``:
the decision slice's tasks at 1k tokens, the first ``--problems`` of each) in kvpress's setting,
the context compressed once after its prefill, 32 new tokens. kvjax runs ``python -m
kvjax.longctx`` (batches of 8; one dense context pass shared by every policy and compression of a
batch, that pass's time stored on the dense rows); kvpress runs ``experiments/kvpress_compare.py``
in its own venv, one problem at a time (its pipeline's own way). Each side starts from an empty
store and kvjax without its persistent compilation cache, so compiling every program (kvjax) and
loading the model (both) are in its wall-clock time.

Reported per method: each side's mean (and median) seconds per record (kvjax's first batch, which
compiles, apart from the rest), and for the whole run: wall-clock seconds (process start to end) per
record, and the sum of per-record seconds per record. Writes ``throughput.md`` and
``summary.json`` to ``--out``; the load average before and after each side is in both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvjax.evaluation.jsonl_gz import read_jsonl  # noqa: E402
from kvjax.real_model import ensure_model  # noqa: E402

TASKS = ["niah_noise", "niah_text", "niah_multikey"]
CONFIG = "configs/longctx-smollm2-baselines-1k.yaml"     # the decision slice's setting
KVPRESS_NAME = {"dense": "none", "adakv": "adakv_snapkv"}  # kvjax policy -> kvpress press; else the same name
BATCH = 8


def timed(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run ``cmd`` (output to ``log``; ``env``: added to the environment); wall-clock seconds and
    the load average around it."""
    before = os.getloadavg()[0]
    t = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}).returncode
    wall = time.perf_counter() - t
    if rc != 0:
        sys.exit(f"eval_throughput: {cmd[0]} ... exited {rc}; its output is in {log}")
    return {"wall_s": round(wall, 1), "load_before": round(before, 2), "load_after": round(os.getloadavg()[0], 2)}


def per_method(records: list[dict], name_of, first_batch: set | None = None) -> dict:
    """``{method: {"n", "median_s", "sum_s", "median_after_first_s", "mean_after_first_s"}}`` over
    ``records``. The mean is the fair figure where work is shared: kvjax charges a batch's one
    KVzip reconstruction pass to its first ratio and reuses it for the second, so KVzip's
    records are bimodal and their median says little."""
    out: dict = {}
    for r in records:
        out.setdefault(name_of(r), []).append(r)
    res = {}
    for m, rs in out.items():
        secs = [r["seconds"] for r in rs]
        later = [r["seconds"] for r in rs if first_batch is None or r["id"] not in first_batch]
        res[m] = {"n": len(rs), "median_s": statistics.median(secs), "sum_s": sum(secs),
                  "median_after_first_s": statistics.median(later) if later else None,
                  "mean_after_first_s": statistics.fmean(later) if later else None}
    return res


def markdown(summary: dict) -> str:
    j, k = summary["kvjax"], summary["kvpress"]
    out = ["| method | records | kvjax s/record, mean | kvjax, batches after the first: mean (median) "
           "| kvpress s/record: mean (median) | kvpress / kvjax, means |", "|---|---|---|---|---|---|"]
    for m in summary["methods"]:
        a, b = j["methods"].get(m), k["methods"].get(KVPRESS_NAME.get(m, m))
        if a is None or b is None:
            out.append(f"| {m} | | {'missing' if a is None else ''} | | {'missing' if b is None else ''} | |")
            continue
        later, later_med = a["mean_after_first_s"] or a["sum_s"] / a["n"], a["median_after_first_s"] or a["median_s"]
        out.append(f"| {m} | {a['n']} | {a['sum_s'] / a['n']:.2f} | {later:.2f} ({later_med:.2f}) "
                   f"| {b['sum_s'] / b['n']:.2f} ({b['median_s']:.2f}) | {b['sum_s'] / b['n'] / later:.1f}x |")
    nj, nk = j["records"], k["records"]
    out += ["", "| whole run | records | wall-clock s | wall-clock s/record | sum of record s / record | load before/after |",
            "|---|---|---|---|---|---|",
            f"| kvjax | {nj} | {j['wall_s']:.0f} | {j['wall_s'] / nj:.2f} | {j['sum_s'] / nj:.2f} "
            f"| {j['load_before']:.2f} / {j['load_after']:.2f} |",
            f"| kvpress | {nk} | {k['wall_s']:.0f} | {k['wall_s'] / nk:.2f} | {k['sum_s'] / nk:.2f} "
            f"| {k['load_before']:.2f} / {k['load_after']:.2f} |",
            "", f"kvpress / kvjax, wall-clock per record: {(k['wall_s'] / nk) / (j['wall_s'] / nj):.1f}x; "
            f"sum of record seconds per record: {(k['sum_s'] / nk) / (j['sum_s'] / nj):.1f}x."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=8, help="problems per task (1k tokens)")
    ap.add_argument("--compressions", type=float, nargs="+", default=[0.75, 0.88])
    ap.add_argument("--methods", nargs="+", default=["dense", "streaming_llm", "snapkv", "tova", "knorm", "pyramidkv",
                                                      "adakv", "keydiff", "kvzip"],
                    help="kvjax policy names that kvpress also has (dense is kvpress's 'none')")
    ap.add_argument("--kvpress-python", default=".venv-kvpress/bin/python",
                    help="the Python with kvpress 0.5.5 (`bash experiments/kvpress_venv.sh` makes it)")
    ap.add_argument("--out", type=Path, default=Path("runs/eval-throughput"))
    args = ap.parse_args(argv)
    if not (ROOT / args.kvpress_python).exists() and not Path(args.kvpress_python).exists():
        sys.exit(f"eval_throughput: --kvpress-python {args.kvpress_python} not found; make it with "
                 "`bash experiments/kvpress_venv.sh`")
    if "dense" not in args.methods:
        args.methods = ["dense", *args.methods]      # kvjax's dense rows carry the shared context pass
    out = args.out.resolve()
    if (out / "kvjax").exists() or (out / "kvpress").exists():
        sys.exit(f"eval_throughput: {out} already holds a run; give a new --out (each side starts from an empty store)")
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    sets = ["--set", "lengths=[1024]", "--set", f"problems={args.problems}", "--set", f"tasks=[{', '.join(TASKS)}]",
            "--set", f"compressions=[{', '.join(map(str, args.compressions))}]",
            "--set", f"policies=[{', '.join(args.methods)}]", "--set", f"batch_size={BATCH}",
            "--set", "learned={}", "--set", "learned_budgets={}"]     # kvpress has no learned rows
    problems = out / "problems.jsonl"
    subprocess.run([py, "-m", "kvjax.longctx", "--config", CONFIG, *sets, "--export-problems", str(problems)],
                   cwd=ROOT, check=True, capture_output=True)
    model = str(ensure_model())

    print(f"kvjax: {len(args.methods)} methods on {len(TASKS) * args.problems} problems ...", flush=True)
    j = timed([py, "-m", "kvjax.longctx", "--config", CONFIG, *sets, "--set", f"out_dir={out / 'kvjax'}"],
              out / "kvjax.log", env={"KVJAX_COMPILE_CACHE": "off"})     # cold: every program compiles
    print(f"kvpress: the same ... ({j['wall_s']:.0f} s for kvjax)", flush=True)
    k = timed([args.kvpress_python, "experiments/kvpress_compare.py", "--problems", str(problems), "--model", model,
               "--presses", *[KVPRESS_NAME.get(m, m) for m in args.methods],
               "--compressions", *map(str, args.compressions), "--max-new", "32", "--window", "32", "--kernel", "7",
               "--sinks", "4", "--out", str(out / "kvpress")], out / "kvpress.log")

    ours = read_jsonl(out / "kvjax" / "problems.jsonl.gz")
    for r in ours:
        r["id"] = f"{r['length']}/{r['task']}/{r['index']}"
    order = [f"1024/{t}/{i}" for i in range(args.problems) for t in TASKS]   # kvjax.longctx's batch order
    first = set(order[:BATCH])                                                  # the batch that compiles
    theirs = read_jsonl(out / "kvpress" / "records.jsonl.gz")
    summary = {"methods": args.methods, "problems_per_task": args.problems, "compressions": args.compressions,
               "cores": os.cpu_count(),
               "kvjax": {**j, "records": len(ours), "sum_s": sum(r["seconds"] for r in ours),
                         "methods": per_method(ours, lambda r: r["policy"], first)},
               "kvpress": {**k, "records": len(theirs), "sum_s": sum(r["seconds"] for r in theirs),
                           "methods": per_method(theirs, lambda r: r["press"])}}
    md = markdown(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "throughput.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
