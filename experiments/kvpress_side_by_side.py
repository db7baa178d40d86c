"""kvjax's and kvpress's rows together, problem by problem, on the same token ids.

    python experiments/kvpress_side_by_side.py --kvjax runs/longctx/smollm2-1k-compressed [more folders] \\
        --kvpress runs/kvpress-compare [--out runs/kvpress-side-by-side.md]

``--kvjax``: a ``python -m kvjax.longctx`` folder run with ``prefill: compressed`` (kvpress's
setting); ``--kvpress``: a ``experiments/kvpress_compare.py`` folder over the problems that run
exported (``--export-problems``). For every method both ran (dense = kvpress's ``none``) and
every compression: each side's mean score with its standard error over the problems both
answered, how many answers are the same text, and how many problems score the same. Then every
kvjax policy and every kvpress press (those without a counterpart too, e.g. KeyDiff and
ExpectedAttention) in one table, over the problems that every kvjax row and kvpress's dense run
answered; a press not yet run on all of them (a sweep in progress) is named, not tabled.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvjax.evaluation.jsonl_gz import read_jsonl  # noqa: E402  (standard library only)

SAME_METHOD = {"dense": "none", "streaming_llm": "streaming_llm", "snapkv": "snapkv", "tova": "tova",
               "knorm": "knorm", "pyramidkv": "pyramidkv", "adakv": "adakv_snapkv", "keydiff": "keydiff",
               "kvzip": "kvzip"}


def _read(path: Path) -> list[dict]:
    """kvpress_compare's records (``records.jsonl.gz``, or a legacy ``records.jsonl`` beside it)."""
    if not path.is_file() and path.with_suffix("").is_file():
        path = path.with_suffix("")
    if not path.is_file():
        sys.exit(f"kvpress_side_by_side: {path} does not exist")
    return read_jsonl(path)


def _read_store(folder: Path) -> list[dict]:
    """A kvjax results folder's records (``problems.jsonl.gz``)."""
    from kvjax.evaluation.results_store import read_records, store_file

    if not store_file(folder).is_file():
        sys.exit(f"kvpress_side_by_side: {store_file(folder)} does not exist")
    return read_records(folder)


def _mean_and_se(x: list[float]) -> tuple[float, float]:
    m = sum(x) / len(x)
    if len(x) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x))


def _mean_se(x: list[float]) -> str:
    m, se = _mean_and_se(x)
    return f"{m:.1%}" if len(x) < 2 else f"{m:.1%} ± {se:.1%}"


def _keyed(kvjax_records: list[dict], kvpress_records: list[dict]) -> tuple[dict, dict]:
    """Both sides' records by ``(policy or press, compression, problem id)``."""
    ours = {(r["policy"], round(r["compression"], 4), f"{r['length']}/{r['task']}/{r['index']}"): r
            for r in kvjax_records}
    theirs = {(r["press"], round(r["compression"], 4), r["id"]): r for r in kvpress_records}
    return ours, theirs


def side_by_side(kvjax_records: list[dict], kvpress_records: list[dict]) -> str:
    ours, theirs = _keyed(kvjax_records, kvpress_records)
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


def every_row(kvjax_records: list[dict], kvpress_records: list[dict]) -> str:
    """kvjax's policies, then kvpress's presses, one row each, one column per compression kvjax holds
    (dense and kvpress's ``none`` in every column), over the problems every kvjax row and kvpress's
    ``none`` answered. A press not yet run on all of them at every column (a sweep in progress) is
    named below the table with the records it has, rather than shrinking everyone's problems."""
    ours, theirs = _keyed(kvjax_records, kvpress_records)
    comps = sorted({c for (_, c, _) in ours if c > 0}) or sorted({c for (_, c, _) in theirs if c > 0})
    rows = [("kvjax", p, ours, "dense") for p in dict.fromkeys(k[0] for k in ours)]
    rows += [("kvpress", p, theirs, "none") for p in dict.fromkeys(k[0] for k in theirs)]
    # dense and kvpress's `none` are stored at compression 0 and fill every column
    at = {(lib, name, comp): 0.0 if name == dense else comp for lib, name, _, dense in rows for comp in comps}

    def held(lib, name, side):
        return set.intersection(*({i for (n, c, i) in side if n == name and c == at[(lib, name, comp)]}
                                  for comp in comps))

    base = [r for r in rows if r[0] == "kvjax" or r[1] == "none"]
    common = sorted(set.intersection(*(held(lib, name, side) for lib, name, side, _ in base))) if base and comps \
        else []
    if not common:
        return "no problem is answered by every kvjax policy and by kvpress's dense run (`none`)"
    partial = [(name, sum(1 for (n, c, i) in theirs if n == name)) for lib, name, side, _ in rows
               if lib == "kvpress" and not set(common) <= held(lib, name, side)]
    rows = [r for r in rows if r[0] == "kvjax" or r[1] not in dict(partial)]
    per_task = collections.Counter(i.rsplit("/", 1)[0] for i in common)
    out = [f"{len(common)} problems ({', '.join(f'{t}: {n}' for t, n in sorted(per_task.items()))}); "
           "mean score ± SE; dense and kvpress's `none` evict nothing",
           "", "| library | policy | " + " | ".join(f"{c:.0%}" for c in comps) + " |",
           "|---|---|" + "---|" * len(comps)]
    scores = {(lib, name, comp): [side[(name, at[(lib, name, comp)], i)]["score"] for i in common]
              for lib, name, side, _ in rows for comp in comps}
    for lib, name, _, _ in rows:
        out.append(f"| {lib} | {name} | " + " | ".join(_mean_se(scores[(lib, name, c)]) for c in comps) + " |")
    out.append("")
    for comp in comps:                 # each library's best evicting row, and their gap paired by problem
        best = {lib: max((k for k in scores if k[0] == lib and k[2] == comp and k[1] not in ("dense", "none")),
                         key=lambda k: sum(scores[k]))
                for lib in ("kvjax", "kvpress") if any(k[0] == lib for k in scores)}
        if len(best) < 2:
            continue
        m, se = _mean_and_se([x - y for x, y in zip(scores[best["kvjax"]], scores[best["kvpress"]])])
        out.append(f"At {comp:.0%}: kvjax's best, {best['kvjax'][1]}, minus kvpress's best, "
                   f"{best['kvpress'][1]}: {100 * m:+.1f} ± {100 * se:.1f} points (paired by problem).")
    if partial:
        out.append(f"\nNot yet on all {len(common)} problems at every column, so left out: "
                   + ", ".join(f"{name} ({n} records)" for name, n in partial) + ".")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvjax", type=Path, required=True, nargs="+",
                    help="python -m kvjax.longctx output folders (their records together)")
    ap.add_argument("--kvpress", type=Path, required=True, help="experiments/kvpress_compare.py output folder")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    ours = [r for folder in args.kvjax for r in _read_store(folder)]
    theirs = _read(args.kvpress / "records.jsonl.gz")
    md = (side_by_side(ours, theirs) + "\n\n**Every kvjax policy and every kvpress press**\n\n"
          + every_row(ours, theirs))
    if args.out:
        args.out.write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
