"""The decision slice against the full long-context table: does the small table rank policies as
the full one does, and what does it cost?

    python -m kvjax.longctx.decision_slice --full configs/longctx-smollm2-compressed.yaml \\
        --slice configs/longctx-smollm2-baselines-1k.yaml

The slice is a sub-table of the full one (its lengths, tasks and first ``problems`` per task, the
same problems and token ids). A policy's slice score and time come from the slice's own store
where it holds that policy (a fresh run of the slice config, today's code and machine), and
otherwise from the full store's records on the slice's problems, so a slice config that runs only
a few policies (KeyDiff, KVzip, ...) is still compared against every full-table row. For each compression both tables give each policy one score: the slice's task average
(over the tasks dense solves) and the full table's mean over its lengths of the same average. The
agreement is Spearman's rho (and Kendall's tau) over the policies both hold, dense left out. The
slice's cost is the sum of the stored per-problem ``seconds`` of its records, per policy: what
rerunning that row on the slice took when its records were written (machine load not recorded).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from kvjax.longctx.report import report
from kvjax.longctx.run import LongCtxConfig


def _full_scores(tab: dict, cfg: LongCtxConfig) -> dict:
    """``{(compression, policy): mean over lengths of the task average}`` (lengths where it exists)."""
    out: dict = {}
    for (L, comp, p), (m, _, _) in tab["average"].items():
        out.setdefault((comp, p), []).append(m)
    return {k: float(np.mean(v)) for k, v in out.items() if len(v) == len(cfg.lengths)}


def compare(full: LongCtxConfig, slc: LongCtxConfig) -> dict:
    """Slice and full-table scores, rank agreement per compression, and the slice's time per policy."""
    from scipy.stats import kendalltau, spearmanr

    missing = [L for L in slc.lengths if L not in full.lengths] + [t for t in slc.tasks if t not in full.tasks]
    if missing:
        raise ValueError(f"the slice's {missing[0]!r} is not in the full table: the slice must be a sub-table")
    # the full-table policies on the slice's problems, read from the full store
    as_slice = dataclasses.replace(full, lengths=list(slc.lengths), tasks=list(slc.tasks), problems=slc.problems,
                                   problems_at={})
    from_full = report(as_slice)
    own = report(slc)
    L = slc.lengths[0] if len(slc.lengths) == 1 else None
    if L is None:
        raise ValueError("the decision slice compares one length; give the slice config one length")
    slice_scores, seconds = {}, {}
    for tab in (from_full, own):                 # the slice's own records win where both hold a policy
        for (length, comp, p), cell in tab["average"].items():
            slice_scores[(comp, p)] = cell
        per: dict = {}
        for r in tab["records"]:
            per[r["policy"]] = per.get(r["policy"], 0.0) + r["seconds"]
        seconds.update(per)
    full_scores = _full_scores(report(full), full)
    rows, agreement = [], {}
    for comp in slc.compressions:
        both = sorted(p for (c, p) in full_scores if c == comp and (comp, p) in slice_scores and p != "dense")
        a = [slice_scores[(comp, p)][0] for p in both]
        b = [full_scores[(comp, p)] for p in both]
        rho = spearmanr(a, b).statistic if len(both) > 2 else float("nan")
        tau = kendalltau(a, b).statistic if len(both) > 2 else float("nan")
        agreement[comp] = {"spearman": float(rho), "kendall": float(tau), "policies": len(both)}
    policies = sorted({p for (_, p) in slice_scores}, key=lambda p: -slice_scores.get((slc.compressions[0], p),
                                                                                       slice_scores.get((0.0, p)))[0])
    for p in policies:
        rows.append({"policy": p, "seconds": seconds.get(p, float("nan")),
                     **{f"slice@{c:g}": slice_scores.get((c, p), slice_scores.get((0.0, p))) for c in slc.compressions},
                     **{f"full@{c:g}": full_scores.get((c, p), full_scores.get((0.0, p))) for c in slc.compressions}})
    return {"rows": rows, "agreement": agreement, "length": L, "slice_problems": from_full["complete"],
            "total_seconds": float(sum(seconds.values()))}


def markdown(res: dict, compressions) -> str:
    head = ("| policy | " + " | ".join(f"slice {c:.0%} | full {c:.0%}" for c in compressions)
            + " | slice time (min) |")
    lines = [head, "|---|" + "---|---|" * len(compressions) + "---|"]
    for r in res["rows"]:
        cells = []
        for c in compressions:
            s, f = r[f"slice@{c:g}"], r[f"full@{c:g}"]
            cells += [f"{s[0]:.1%} ± {s[1]:.1%}" if s else "-", f"{f:.1%}" if f is not None else "-"]
        lines.append(f"| {r['policy']} | " + " | ".join(cells) + f" | {r['seconds'] / 60:.1f} |")
    agree = "; ".join(f"{c:.0%}: Spearman {a['spearman']:.2f}, Kendall {a['kendall']:.2f} over {a['policies']} "
                      f"policies" for c, a in res["agreement"].items())
    return ("\n".join(lines) + f"\n\nrank agreement, slice vs full table (mean over its lengths): {agree}. "
            f"Every row on the slice: {res['total_seconds'] / 60:.0f} min of stored per-problem time.")


def main(argv=None) -> int:
    import argparse

    from kvjax.configio import ConfigError, load_config

    ap = argparse.ArgumentParser(prog="python -m kvjax.longctx.decision_slice", description=__doc__.split("\n\n")[0],
                                 epilog="example:\n  python -m kvjax.longctx.decision_slice --full "
                                        "configs/longctx-smollm2-compressed.yaml --slice "
                                        "configs/longctx-smollm2-baselines-1k.yaml",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", required=True, help="the full table's longctx config")
    ap.add_argument("--slice", required=True, help="the decision slice's longctx config")
    args = ap.parse_args(argv)
    try:
        full, slc = load_config(LongCtxConfig, args.full), load_config(LongCtxConfig, args.slice)
        res = compare(full, slc)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"python -m kvjax.longctx.decision_slice: {e}", file=sys.stderr)
        return 2
    print(markdown(res, slc.compressions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
