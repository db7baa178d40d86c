"""The learning curve of a ``train.py`` run: held-out accuracy per token category and answer
accuracy against steps and wall time, from its ``eval.jsonl``.

    python -m kvjax.evaluation.learning_curve runs/testbed-teacher [--out curve.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SERIES = (("lookup_near", "lookup near"), ("lookup_far", "lookup far"), ("compute", "compute"),
          ("answer", "answer (free generation)"))


def plot_learning_curve(run_dir, out=None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    log = run_dir / "eval.jsonl"
    if not log.exists():
        raise FileNotFoundError(f"{log}: no held-out evaluations (set log.eval_every in the run's config)")
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    out = Path(out) if out else run_dir / "learning_curve.png"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in ((axes[0], "step", "step"), (axes[1], "wall_s", "wall time (min)")):
        for key, name in SERIES:
            pts = [(r[x] / (60 if x == "wall_s" else 1), r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xlabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("held-out accuracy")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend()
    fig.suptitle(f"learning curve: {run_dir}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    print(plot_learning_curve(args.run_dir, args.out))


if __name__ == "__main__":
    main()
