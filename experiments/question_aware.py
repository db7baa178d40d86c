"""Question-aware against question-agnostic prefill compression, problem by problem.

    python experiments/question_aware.py [--agnostic results/longctx/smollm2-compressed] \\
        [--aware results/longctx/smollm2-question-aware] [--length 1024]

Both folders are ``python -m kvjax.longctx`` stores in kvpress's setting over the same token
ids: the agnostic one compresses the context and feeds the question after it, the aware one
(``question_aware: true``) compresses the context and the question together. Only problems
with every record in both folders count (so N is paired); for every policy and compression:
the mean score on the tasks the dense model solves (>= 50%), each side ± its standard error,
and the paired difference (aware - agnostic) ± its SE.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _read(folder: Path) -> dict:
    from kvjax.evaluation.results_store import read_records, store_file

    if not store_file(folder).is_file():
        raise SystemExit(f"question_aware: {store_file(folder)} does not exist")
    return {r["key"]: r for r in read_records(folder)}


def _se(x: list[float]) -> float:
    if len(x) < 2:
        return float("nan")
    m = sum(x) / len(x)
    return math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x))


def compare(agnostic: dict, aware: dict, length: int) -> str:
    both = [k for k in aware if k in agnostic and agnostic[k]["length"] == length]
    cells = {(agnostic[k]["policy"], agnostic[k]["compression"]) for k in both}
    per_problem: dict = {}
    for k in both:
        per_problem.setdefault((agnostic[k]["task"], agnostic[k]["index"]), []).append(k)
    both = [k for keys in per_problem.values() if len(keys) == len(cells) for k in keys]    # complete problems
    dense = {}
    for k in both:
        if agnostic[k]["policy"] == "dense":
            dense.setdefault(agnostic[k]["task"], []).append(agnostic[k]["score"])
    solved = sorted(t for t, v in dense.items() if sum(v) / len(v) >= 0.5)
    rows = [f"{length} tokens, tasks dense solves: {', '.join(solved)}", "",
            "| policy | compression | problems | question-agnostic | question-aware | aware - agnostic (paired) |",
            "|---|---|---|---|---|---|"]
    for policy, comp in sorted(cells, key=lambda pc: (pc[1], pc[0] != "dense", pc[0])):
        keys = [k for k in both if agnostic[k]["policy"] == policy and agnostic[k]["compression"] == comp
                and agnostic[k]["task"] in solved]
        a = [agnostic[k]["score"] for k in keys]
        b = [aware[k]["score"] for k in keys]
        d = [y - x for x, y in zip(a, b)]
        mean = lambda v: sum(v) / len(v)       # noqa: E731
        rows.append(f"| {policy} | {comp:.0%} | {len(keys)} | {mean(a):.1%} ± {_se(a):.1%} | {mean(b):.1%} ± "
                    f"{_se(b):.1%} | {mean(d):+.1%} ± {_se(d):.1%} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agnostic", type=Path, default=ROOT / "results/longctx/smollm2-compressed")
    ap.add_argument("--aware", type=Path, default=ROOT / "results/longctx/smollm2-question-aware")
    ap.add_argument("--length", type=int, default=1024)
    args = ap.parse_args(argv)
    print(compare(_read(args.agnostic), _read(args.aware), args.length))


if __name__ == "__main__":
    main()
