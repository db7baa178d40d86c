"""kvjax's and kvpress's rows together, problem by problem, on the same token ids.

    python bench/kvpress_side_by_side.py --kvjax runs/longctx/smollm2-1k-compressed \\
        --kvpress runs/kvpress-compare [--out docs/kvpress-side-by-side.md]

``--kvjax``: a ``python -m kvjax.longctx`` folder run with ``prefill: compressed`` (kvpress's
setting); ``--kvpress``: a ``bench/kvpress_compare.py`` folder over the problems that run
exported (``--export-problems``). For every method both ran (dense = kvpress's ``none``) and
every compression: each side's mean score with its standard error over the problems both
answered, how many answers are the same text, and how many problems score the same.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SAME_METHOD = {"dense": "none", "streaming_llm": "streaming_llm", "snapkv": "snapkv", "tova": "tova",
               "knorm": "knorm", "pyramidkv": "pyramidkv", "adakv": "adakv_snapkv"}


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        sys.exit(f"kvpress_side_by_side: {path} does not exist")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean_se(x: list[float]) -> str:
    m = sum(x) / len(x)
    if len(x) < 2:
        return f"{m:.1%}"
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1))
    return f"{m:.1%} ± {sd / math.sqrt(len(x)):.1%}"


def side_by_side(kvjax_records: list[dict], kvpress_records: list[dict]) -> str:
    ours = {(r["policy"], round(r["compression"], 4), f"{r['length']}/{r['task']}/{r['index']}"): r
            for r in kvjax_records}
    theirs = {(r["press"], round(r["compression"], 4), r["id"]): r for r in kvpress_records}
    rows = ["| method | compression | problems | kvjax | kvpress | same answer text | same score |",
            "|---|---|---|---|---|---|---|"]
    for policy, press in SAME_METHOD.items():
        for comp in sorted({c for (p, c, _) in ours if p == policy}):
            ids = sorted(i for (p, c, i) in ours if p == policy and c == comp and (press, comp, i) in theirs)
            if not ids:
                continue
            a = [ours[(policy, comp, i)] for i in ids]
            b = [theirs[(press, comp, i)] for i in ids]
            text = sum(x["answer"].strip() == y["output"][:160].strip() for x, y in zip(a, b))
            same = sum(x["score"] == y["score"] for x, y in zip(a, b))
            rows.append(f"| {policy} | {comp:.0%} | {len(ids)} | {_mean_se([x['score'] for x in a])} | "
                        f"{_mean_se([y['score'] for y in b])} | {text}/{len(ids)} | {same}/{len(ids)} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvjax", type=Path, required=True, help="python -m kvjax.longctx output folder")
    ap.add_argument("--kvpress", type=Path, required=True, help="bench/kvpress_compare.py output folder")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    md = side_by_side(_read(args.kvjax / "problems.jsonl"), _read(args.kvpress / "records.jsonl"))
    if args.out:
        args.out.write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
