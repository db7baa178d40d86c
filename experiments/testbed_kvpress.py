"""Why kvjax and kvpress disagreed on the synthetic testbed: the setting, measured problem by problem.

    python experiments/testbed_kvpress.py export --out runs/testbed-kvpress          # problems.jsonl
    .venv-kvpress/bin/python experiments/kvpress_compare.py --problems runs/testbed-kvpress/problems.jsonl \\
        --model assets/testbed-teacher --presses streaming_llm snapkv --compressions 0.75 \\
        --window 16 --kernel 7 --sinks 4 --max-new 32 --out runs/testbed-kvpress/kvpress
    python experiments/testbed_kvpress.py compare --out runs/testbed-kvpress        # the table

A testbed problem is a program (the context) whose last line asks a query; the model answers
with a line (``answer n1 v1 -> ...``). ``export`` writes the held-out problems of the quality
table (test split, 512 tokens) for ``experiments/kvpress_compare.py``: the context is everything
before the ``query`` line, the question the query line up to ``answer`` (where the quality
table starts generating). ``compare`` answers the same problems with kvjax in two settings

* **bounded** -- the testbed quality table's (``python eval.py --config
  configs/testbed-quality.yaml``): the whole prompt, query line included, under the policy's
  budget ``round((1 - c) * 512)`` (4 sinks, a window of 1/16 of it), every prompt query seeing
  only its kept set (StreamingLLM) or a dense prefill compressed when the prompt ends (SnapKV),
  and eviction going on while the answer is generated;
* **compressed** -- kvpress's: dense prefill of the context, the context compressed once to
  ``round((1 - c) * n)`` (kvpress: ``int``), the query line and the answer never evicted
  (:mod:`kvjax.eviction.shared_prefill`); SnapKV with kvpress's knobs (no sinks, the observation
  window of 16 the protected window, kernel 7),

and counts, against kvpress's answers, how many answer lines are identical and how many are right.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvjax.evaluation.jsonl_gz import read_jsonl  # noqa: E402  (standard library only)

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def problems(num: int):
    from kvjax.data import TestbedConfig, generate_problem
    from kvjax.data.vocab import tok

    out = []
    for i in range(num):
        p = generate_problem(TestbedConfig(length=512), "test", i)
        ids = p.tokens[: p.answer_start].tolist()
        q = max(j for j, t in enumerate(ids) if t == tok("query"))
        out.append({"id": f"test/{i}", "task": "testbed", "length": 512, "context_ids": ids[:q],
                    "question_ids": ids[q:], "answers": [str(p.answer)], "metric": "any", "answer": int(p.answer)})
    return out


def export(args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "problems.jsonl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(p) + "\n" for p in problems(args.problems)))
    tmp.replace(path)
    print(f"{args.problems} problems -> {path}")


def line(ids, eos: int) -> list[int]:
    """The generated ids up to (not including) the first EOS."""
    ids = [int(t) for t in ids]
    return ids[: ids.index(eos)] if eos in ids else ids


def kvjax_answers(model, probs, name: str, c: float, setting: str, max_new: int = 32, batch: int = 50) -> list[list[int]]:
    import dataclasses

    import kvjax
    from kvjax.data.vocab import EOS, tok
    from kvjax.evaluation.budgets import budget_for, fixed_window_budget
    from kvjax.eviction.prompt_compressed import prompt_compressed
    from kvjax.eviction.shared_prefill import answer, compress, prefill_context
    from kvjax.sampling import bucket

    eos, out = tok(EOS), []
    for s in range(0, len(probs), batch):
        chunk = probs[s:s + batch]
        if setting == "bounded":
            pol = kvjax.make_policy(name, budget_for(512, c))
            prompts = [p["context_ids"] + p["question_ids"] for p in chunk]
            new = np.asarray(kvjax.generate(model, prompts, max_new, policy=pol, eos_token_id=eos))
            new = new[:, new.shape[1] - max_new:]
        else:
            ctx = [len(p["context_ids"]) for p in chunk]
            ev = (fixed_window_budget(512, c, sinks=0, window=16) if name == "snapkv"
                  else budget_for(512, c))            # StreamingLLM: 4 sinks + the most recent context tokens
            pol = prompt_compressed(kvjax.make_policy(name, dataclasses.replace(ev, obs_window=16, pool=7)), c, ctx)
            q = max(len(p["question_ids"]) for p in chunk)
            pre = prefill_context(model, [p["context_ids"] for p in chunk], keep_queries=name == "snapkv",
                                  cache_len=bucket(max(ctx)) + bucket(q) + bucket(max_new))
            new = answer(model, compress(pol, model, pre), [p["question_ids"] for p in chunk], ctx, max_new,
                         eos_ids=[eos], pad_id=eos)
        out += [line(r, eos) for r in new]
    return out


def compare(args) -> None:
    import kvjax
    from kvjax.data.metrics import check_answer
    from kvjax.data.vocab import TOKEN_TO_ID

    probs = [json.loads(x) for x in (args.out / "problems.jsonl").read_text().splitlines()]
    theirs = {}
    for r in read_jsonl(args.out / "kvpress" / "records.jsonl.gz"):
        theirs[(r["press"], round(r["compression"], 4), r["id"])] = [TOKEN_TO_ID[w] for w in r["output"].split()]
    model = kvjax.load_hf(args.teacher)
    rows = ["| method | compression | kvjax setting | problems | kvjax answers | kvpress answers | "
            "identical lines | same right/wrong |", "|---|---|---|---|---|---|---|---|"]
    for name in args.policies:
        for c in args.compressions:
            have = [p for p in probs if (name, round(c, 4), p["id"]) in theirs]
            if not have:
                sys.exit(f"testbed_kvpress: no kvpress records of {name} at {c} in {args.out / 'kvpress'}")
            kp = [theirs[(name, round(c, 4), p["id"])] for p in have]
            kp_right = [check_answer(x, p["answer"]) for x, p in zip(kp, have)]
            for setting in ("bounded", "compressed"):
                ours = kvjax_answers(model, have, name, c, setting)
                right = [check_answer(x, p["answer"]) for x, p in zip(ours, have)]
                same = sum(a == b for a, b in zip(ours, kp))
                agree = sum(a == b for a, b in zip(right, kp_right))
                rows.append(f"| {name} | {c:.0%} | {setting} | {len(have)} | {_pct(right)} | {_pct(kp_right)} | "
                            f"{same}/{len(have)} | {agree}/{len(have)} |")
    text = "\n".join(rows)
    (args.out / "table.md").write_text(text + "\n")
    print(text)


def _pct(x) -> str:
    x = np.asarray(x, float)
    return f"{x.mean():.1%} ± {x.std(ddof=1) / math.sqrt(len(x)):.1%}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=("export", "compare"))
    ap.add_argument("--out", type=Path, default=ROOT / "runs/testbed-kvpress")
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--teacher", type=Path, default=ROOT / "assets/testbed-teacher")
    ap.add_argument("--policies", nargs="+", default=["streaming_llm", "snapkv"])
    ap.add_argument("--compressions", nargs="+", type=float, default=[0.75])
    args = ap.parse_args(argv)
    export(args) if args.step == "export" else compare(args)


if __name__ == "__main__":
    main()
