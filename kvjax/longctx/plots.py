"""The long-context runner's figures: accuracy vs compression per task, and the needle
heatmap (needle depth x context length) of dense, the best heuristic and the best learned
policy. Both read the runner's per-problem records (``problems.jsonl.gz``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvjax.longctx.run import _mean_se
from kvjax.longctx.tasks import DEPTHS, TASKS


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accuracy_vs_compression(records: list[dict], path, title: str = "", learned=()) -> Path:
    """One panel per (task, length): mean score ± SE against compression, a line per policy
    (``learned`` policies solid, heuristics dashed, oracles dotted; 20 distinct colours);
    dense is the black dashed line at its own score."""
    plt = _plt()
    colours = plt.get_cmap("tab20").colors
    panels = sorted({(r["task"], r["length"]) for r in records}, key=lambda x: (x[1], list(TASKS).index(x[0])))
    policies = list(dict.fromkeys(r["policy"] for r in records if r["policy"] != "dense"))
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (task, length) in zip(axes.flat, panels):
        mine = [r for r in records if r["task"] == task and r["length"] == length]
        dense = [r["score"] for r in mine if r["policy"] == "dense"]
        if dense:
            ax.axhline(np.mean(dense), color="k", ls="--", lw=1, label=f"dense (N={len(dense)})")
        for j, p in enumerate(policies):
            comps = sorted({r["compression"] for r in mine if r["policy"] == p})
            ms = [_mean_se([r["score"] for r in mine if r["policy"] == p and r["compression"] == c]) for c in comps]
            style = "-" if p in learned else ":" if p.startswith("oracle") else "--"
            ax.errorbar([c * 100 for c in comps], [m for m, _ in ms], yerr=[s for _, s in ms], marker="o", ms=3,
                        capsize=2, label=p, color=colours[j % len(colours)], ls=style, lw=1.6 if p in learned else 1)
        ax.set_title(f"{task}, {length} tokens", fontsize=9)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("compression (%)", fontsize=8)
        ax.set_ylabel("score", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def best_policies(average: dict, learned: list[str], compression: float) -> list[str]:
    """``["dense", best heuristic, best learned]`` by the task average over lengths at
    ``compression`` (``average``: :func:`kvjax.longctx.run.table`'s ``{(length, comp, policy): (mean, ...)}``);
    oracles count as neither."""
    score: dict[str, list[float]] = {}
    for (_length, comp, p), (m, *_rest) in average.items():
        if abs(comp - compression) < 1e-9 and p != "dense" and not p.startswith("oracle"):
            score.setdefault(p, []).append(m)
    rank = sorted(score, key=lambda p: -np.mean(score[p]))
    heur = [p for p in rank if p not in learned][:1]
    lrn = [p for p in rank if p in learned][:1]
    return ["dense", *heur, *lrn]


def needle_heatmap(records: list[dict], policies: list[str], compression: float, path, title: str = "") -> Path:
    """Needle tasks only: mean score per (depth, length) cell, one panel per policy (dense at
    compression 0), the number of problems in each cell written in it."""
    plt = _plt()
    needles = [r for r in records if r["task"].startswith("niah") and r.get("depth") is not None]
    lengths = sorted({r["length"] for r in needles})
    fig, axes = plt.subplots(1, len(policies), figsize=(2.2 + 1.3 * len(lengths) * len(policies), 3.4), squeeze=False)
    for ax, p in zip(axes[0], policies):
        comp = 0.0 if p == "dense" else compression
        grid = np.full((len(DEPTHS), len(lengths)), np.nan)
        count = np.zeros_like(grid, int)
        for i, d in enumerate(DEPTHS):
            for j, n in enumerate(lengths):
                v = [r["score"] for r in needles if r["policy"] == p and abs(r["compression"] - comp) < 1e-9
                     and r["length"] == n and abs(r["depth"] - d) < 1e-9]
                if v:
                    grid[i, j], count[i, j] = np.mean(v), len(v)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(DEPTHS)):
            for j in range(len(lengths)):
                if count[i, j]:
                    ax.text(j, i, f"{grid[i, j]:.0%}\n({count[i, j]})", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
        ax.set_yticks(range(len(DEPTHS)), [f"{d:.0%}" for d in DEPTHS], fontsize=8)
        ax.set_xlabel("context length (tokens)", fontsize=8)
        ax.set_title(p if p == "dense" else f"{p} at {compression:.0%}", fontsize=9)
    axes[0, 0].set_ylabel("needle depth", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.03, label="score")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def write_figures(records: list[dict], average: dict, learned: list[str], compressions: list[float], out_dir,
                  setting: str) -> list[Path]:
    """Both figures into ``out_dir`` (the heatmap at 75% if run, else the first compression)."""
    out = Path(out_dir)
    paths = [accuracy_vs_compression(records, out / "accuracy_vs_compression.png", f"SmolLM2, {setting}",
                                     learned=learned)]
    c = 0.75 if 0.75 in compressions else compressions[0]
    if any(r["task"].startswith("niah") for r in records):
        paths.append(needle_heatmap(records, best_policies(average, learned, c), c, out / "needle_heatmap.png",
                                    f"needle tasks, {setting}"))
    return paths
