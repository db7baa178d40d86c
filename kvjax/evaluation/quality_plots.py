"""PNG views of a quality run: retention recall per layer and head (the KVpop seed's
Figure 7), and eviction maps of one trace (Figure 6: per layer, how many heads keep each
token when the answer starts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_recall(rows: list[dict], path: Path) -> Path:
    """One heat map per (length, compression): policies x (layer, head), retention recall."""
    plt = _plt()
    groups = sorted({(r["length"], r["compression"]) for r in rows if "recall_per_head" in r})
    if not groups:
        groups = [(0, 0.0)]
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.5), squeeze=False)
    for ax, (length, comp) in zip(axes[0], groups):
        sel = [r for r in rows if (r["length"], r["compression"]) == (length, comp) and "recall_per_head" in r]
        if not sel:
            ax.set_axis_off()
            continue
        grid = np.array([np.asarray(r["recall_per_head"], float).reshape(-1) for r in sel])
        grid = np.where(grid < 0, np.nan, grid)
        L, K = np.asarray(sel[0]["recall_per_head"]).shape
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_yticks(range(len(sel)), [r["policy"] for r in sel], fontsize=8)
        ax.set_xticks(range(L * K), [f"L{l}H{h}" for l in range(L) for h in range(K)], fontsize=7, rotation=90)
        for (y, x), v in np.ndenumerate(grid):
            if np.isfinite(v):
                ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if v < 0.5 else "black")
        ax.set_title(f"top-k retention recall vs oracle\nlength {length}, {comp:.0%} compression", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_eviction_maps(kept: dict[str, list], one_batch: dict, path: Path, compression: float,
                       last: int = 112) -> Path:
    """For each policy, rows = layers, columns = the last ``last`` prompt tokens of one trace,
    colour = how many KV heads keep the token when the answer starts."""
    from kvjax.data.vocab import TOKENS
    from kvjax.evaluation.retention import eviction_map

    plt = _plt()
    tokens, end = one_batch["tokens"][0], int(one_batch["answer_start"][0])
    lo = max(0, end - last)
    words = [TOKENS[t] for t in tokens[lo:end]]
    names = list(kept)
    fig, axes = plt.subplots(len(names), 1, figsize=(min(0.14 * len(words) + 2, 24), 0.9 * len(names) + 1.2),
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        pos = np.asarray(kept[name])[:, None]                   # [L, 1, K, slots]
        m = eviction_map(pos, 0, len(tokens))[:, lo:end]        # [L, tokens]
        heads = pos.shape[2]
        ax.imshow(m, vmin=0, vmax=heads, cmap="Blues", aspect="auto", interpolation="nearest")
        ax.set_yticks(range(m.shape[0]), [f"L{l}" for l in range(m.shape[0])], fontsize=6)
        ax.set_ylabel(name, fontsize=7, rotation=0, ha="right", va="center")
        ax.set_xticks([])
    axes[-1, 0].set_xticks(range(len(words)), words, fontsize=5, rotation=90)
    fig.suptitle(f"heads keeping each token when the answer starts ({compression:.0%} compression; "
                 f"last {len(words)} prompt tokens)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return Path(path)
