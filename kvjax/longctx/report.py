"""Reading a long-context store: :func:`report` (the table of what a folder holds, while its run
goes on), :func:`overview`, :func:`winners` and :func:`markdown` (the tables printed and written
by ``python -m kvjax.longctx``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from kvjax.longctx.run import ORACLES, SETTING, LongCtxConfig, dense_prefill, table
from kvjax.longctx.tasks import TASKS


# the run fingerprint's fields that come from the config itself (the rest: model, tokenizer, tasks)
REPORT_FIELDS = ("prefill", "seed", "sinks", "window", "obs_window", "pool", "question_aware", "max_new")


def report(cfg: LongCtxConfig) -> dict:
    """:func:`table` of the records already in ``cfg.out_dir``, read without running anything
    (and without the folder's lock, so while a run is adding to it). Only problems with every
    record of this config (every policy at every compression) count, so each cell's N is the
    same across policies and the comparison stays paired. Returns the table plus ``"records"``
    and ``"complete"`` (``{length: {task: problems}}``)."""
    import json

    from kvjax.evaluation.results_store import read_fingerprint, read_records, record_key, store_file

    folder = Path(cfg.out_dir)
    if not store_file(folder).is_file() or not (folder / "fingerprint.json").is_file():
        raise FileNotFoundError(f"{folder}: no stored long-context run (problems.jsonl.gz and fingerprint.json)")
    run = read_fingerprint(folder)["run"]
    clash = [k for k in REPORT_FIELDS if k in run and run[k] != getattr(cfg, k)]
    if clash:
        raise ValueError(f"{folder} holds a run with other settings ({', '.join(f'{k}={run[k]!r}' for k in clash)}) "
                         f"than the config ({', '.join(f'{k}={getattr(cfg, k)!r}' for k in clash)})")
    stored = {}
    for r in read_records(folder):                  # a torn tail is dropped: the run will redo it
        stored[r["key"]] = r
    names = list(dict.fromkeys(["dense", *cfg.policies, *cfg.learned]))
    records, complete = [], {}
    for length in cfg.lengths:
        for i in range(cfg.problems_at.get(length, cfg.problems)):
            for task in cfg.tasks:
                keys = [record_key(length, 0.0 if n == "dense" else c, n, f"{task}/{i}")
                        for n in names for c in ([0.0] if n == "dense" else cfg.compressions)]
                if all(k in stored for k in keys):
                    records += [stored[k] for k in keys]
                    complete.setdefault(length, {}).setdefault(task, 0)
                    complete[length][task] += 1
    return {**table(records, names, cfg), "records": records, "complete": complete}


def length_label(tokens: int) -> str:
    """A column's length: ``1k``, ``4k`` for whole multiples of 1024 tokens, else the token count
    (``512``, ``1536``)."""
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def _mean_se(cell) -> str:
    """A task-average cell ``(mean, se, tasks)`` as ``"mean ± se"``; empty when missing."""
    return f"{cell[0]:.1%} ± {cell[1]:.1%}" if cell else ""


def overview(tab: dict, cfg: LongCtxConfig, names) -> str:
    """One table of every length: rows = policies, columns = (length, compression) task averages
    ± SE; a length appears once its every solvable task has records."""
    cols = [(L, c) for L in cfg.lengths for c in cfg.compressions
            if any(k[0] == L and k[1] == c for k in tab["average"])]
    out = ["| policy | " + " | ".join(f"{length_label(L)}, {c:.0%}" for L, c in cols) + " |",
           "|---|" + "---|" * len(cols)]
    for p in names:
        cells = [_mean_se(tab["average"].get((L, 0.0 if p == "dense" else c, p))) for L, c in cols]
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    per_task = {L: sorted({v[2] for (LL, _c, _p, t), v in tab["cells"].items() if LL == L and t in tab["solvable"][L]})
                for L in cfg.lengths}
    out.append("\nproblems per task: " + "; ".join(f"{L}: {'/'.join(map(str, n)) or 'none yet'}"
                                                  for L, n in per_task.items())
               + "; averaged over the tasks dense solves: " + "; ".join(
                   f"{L}: {', '.join(tab['solvable'][L]) or 'none yet'}" for L in cfg.lengths))
    return "\n".join(out)


def paired_difference(records, length: int, compression: float, a: str, b: str, tasks) -> tuple[float, float]:
    """``(mean, se)``: policy ``a``'s score minus ``b``'s at ``length`` and ``compression``, paired by
    problem. Per task the mean and SE of the per-problem differences (problems both answered);
    the task average's SE combines the tasks' SEs, as :func:`~kvjax.longctx.run.table`'s does."""
    score = {}
    for r in records:
        same_column = r["policy"] == "dense" or r["compression"] == compression
        if r["length"] == length and r["policy"] in (a, b) and same_column:
            score[(r["policy"], r["task"], r["index"])] = r["score"]
    means, ses = [], []
    for t in tasks:
        d = np.asarray([score[(a, tt, i)] - score[(b, tt, i)] for (p, tt, i) in score
                        if p == a and tt == t and (b, t, i) in score], float)
        if not d.size:
            raise ValueError(f"paired_difference: no problem of task {t!r} has both {a!r} and {b!r}")
        means.append(d.mean())
        ses.append(d.std(ddof=1) / math.sqrt(d.size) if d.size > 1 else float("nan"))
    return float(np.mean(means)), math.sqrt(sum(x * x for x in ses)) / len(ses)


def winners(tab: dict, cfg: LongCtxConfig, names) -> str:
    """Who wins where: per (length, compression) column with every policy's task average, the
    first and second policy (hindsight oracles apart) and the first's margin over the second, the
    best learned policy and the best heuristic and the margin between them; margins paired by
    problem over the tasks dense solves (:func:`paired_difference`), in points ± SE."""
    if "records" not in tab:
        return ""
    learned = [p for p in names if p in cfg.learned]
    heuristics = [p for p in names if p != "dense" and p not in learned and p not in ORACLES]
    out = ["| column | first | second | first − second | best learned | best heuristic | learned − heuristic |",
           "|---|---|---|---|---|---|---|"]
    for L in cfg.lengths:
        for c in cfg.compressions:
            avg = {p: tab["average"].get((L, c, p)) for p in names if p != "dense" and p not in ORACLES}
            if not avg or None in avg.values():
                continue
            rank = sorted(avg, key=lambda p: -avg[p][0])

            def cell(p):
                return f"{p} {avg[p][0]:.1%}"

            def margin(a, b):
                m, se = paired_difference(tab["records"], L, c, a, b, tab["solvable"][L])
                return f"{100 * m:+.1f} ± {100 * se:.1f}"

            two = len(rank) > 1
            row = [f"{length_label(L)}, {c:.0%}", cell(rank[0]), cell(rank[1]) if two else "",
                   margin(rank[0], rank[1]) if two else ""]
            best_l = next((p for p in rank if p in learned), None)
            best_h = next((p for p in rank if p in heuristics), None)
            row += [cell(best_l) if best_l else "", cell(best_h) if best_h else "",
                    margin(best_l, best_h) if best_l and best_h else ""]
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out) if len(out) > 2 else ""


def markdown(tab: dict, cfg: LongCtxConfig, names) -> str:
    """The :func:`overview` and :func:`winners`, then per length: rows = policies, columns = the task average at
    each compression (and per task at 75%/88%)."""
    out = [overview(tab, cfg, names)]
    if win := winners(tab, cfg, names):
        out.append("\n**Who wins where** — task averages over the tasks dense solves; margins in points, "
                   "paired by problem, ± SE\n")
        out.append(win)
    for L in cfg.lengths:
        solv = tab["solvable"][L]
        out.append(f"\n**{L} tokens** — task average over the tasks dense solves ({', '.join(solv) or 'none'}); "
                   "mean ± SE, N problems per task in brackets; " + SETTING[cfg.prefill]
                   + ("; question-aware: the question compressed with the context" if cfg.question_aware else "")
                   + "\n")
        comps = list(cfg.compressions)
        out.append("| policy | " + " | ".join(f"{c:.0%}" for c in comps) + " |")
        out.append("|---|" + "---|" * len(comps))
        for p in names:
            cells = [_mean_se(tab["average"].get((L, c, p))) for c in ([0.0] * len(comps) if p == "dense" else comps)]
            n = max((v[2] for (LL, _c, pp, _t), v in tab["cells"].items() if LL == L and pp == p), default=0)
            mark = " †" if cfg.prefill == "auto" and dense_prefill(p) else ""
            out.append(f"| {p}{mark} [{n}] | " + " | ".join(cells) + " |")
        tasks = sorted({t for (LL, _c, _p, t) in tab["cells"] if LL == L}, key=list(TASKS).index)
        for c in [c for c in comps if c in (0.75, 0.88)] or comps[:1]:
            out.append(f"\nper task at {c:.0%} ({L} tokens; dense in the first row)\n")
            out.append("| policy | " + " | ".join(tasks) + " |")
            out.append("|---|" + "---|" * len(tasks))
            for p in names:
                cc = 0.0 if p == "dense" else c
                row = [tab["cells"].get((L, cc, p, t)) for t in tasks]
                out.append(f"| {p} | " + " | ".join(f"{v[0]:.0%}" if v else "" for v in row) + " |")
    return "\n".join(out)
