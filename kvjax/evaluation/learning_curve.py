"""The learning curve of a ``train.py`` run: held-out accuracy per token category and answer
accuracy against steps and wall time, from its ``eval.jsonl``. Several runs are stages of
one recipe (the second continues the first's weights): they are drawn end to end, each
stage's steps and wall time counted on from where the previous stage stopped.

    python -m kvjax.evaluation.learning_curve runs/testbed-teacher [runs/stage-2 ...] [--out curve.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SERIES = (("lookup_near", "lookup near"), ("lookup_far", "lookup far"), ("compute", "compute"),
          ("answer", "answer (free generation)"))


def chained_rows(run_dirs) -> list[dict]:
    """The eval rows of consecutive stages, with steps and ``wall_s`` offset by the earlier stages'
    and each row's ``stage`` index."""
    rows, step0, wall0 = [], 0, 0.0
    for n, run_dir in enumerate(run_dirs):
        log = Path(run_dir) / "eval.jsonl"
        if not log.exists():
            raise FileNotFoundError(f"{log}: no held-out evaluations (set log.eval_every in the run's config)")
        stage = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        rows += [{**r, "step": r["step"] + step0, "wall_s": r["wall_s"] + wall0, "stage": n} for r in stage]
        if stage:
            step0, wall0 = rows[-1]["step"], rows[-1]["wall_s"]
    return rows


def plot_learning_curve(run_dirs, out=None) -> Path:
    """Plot one run (a path) or the stages of one recipe (a list of paths) to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(d) for d in run_dirs]
    rows = chained_rows(run_dirs)
    out = Path(out) if out else run_dirs[-1] / "learning_curve.png"
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
    for ax, x in ((axes[0], "step"), (axes[1], "wall_s")):
        for r, after in zip(rows, rows[1:]):   # a dotted line where one stage hands over to the next
            if after["stage"] != r["stage"]:
                ax.axvline(r[x] / (60 if x == "wall_s" else 1), color="grey", linestyle=":", linewidth=1)
    fig.suptitle("learning curve: " + " + ".join(str(d) for d in run_dirs))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", metavar="run_dir")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    print(plot_learning_curve(args.run_dirs, args.out))


if __name__ == "__main__":
    main()
