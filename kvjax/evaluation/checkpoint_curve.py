"""Quality against training steps for a ``distill_kvpop`` run: each kept checkpoint's scorers,
on the student backbone of that step and on the run's teacher, in one testbed quality
evaluation (``eval.py``'s, resumable), so a reader sees whether longer distillation makes the
student answer better under its own eviction (issue 21: does the student stop leaning on the
context its cache drops?).

    python -m kvjax.evaluation.checkpoint_curve runs/testbed-kvpop-mlstm-long --steps 150 300 900 \\
        --num-problems 128 --compressions 0.75 --out runs/kvpop-curve
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def checkpoint_curve(run_dir, steps, out_dir, *, num_problems: int = 128, compressions=(0.75,),
                     batch_size: int = 32) -> dict:
    """Export every step's scorers and student under ``out_dir/step-N`` (skipped when present),
    then evaluate ``dense``, ``s{N}`` (the student with its scorers) and ``s{N}_teacher`` (the
    teacher with the same scorers); returns ``eval.py``'s result (rows, per-problem store)."""
    from kvjax.evaluation.cli import run_quality
    from kvjax.evaluation.config import EvalConfig
    from kvjax.export import export_checkpoint

    run_dir, out = Path(run_dir), Path(out_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    if cfg.get("mode") != "distill_kvpop":
        raise ValueError(f"{run_dir}: a distill_kvpop run is needed (mode {cfg.get('mode')!r})")
    teacher = cfg["model"]["hf_path"]
    scorers, students = {}, {}
    for step in steps:
        at = out / f"step-{step}"
        if not (at / "student" / "config.json").exists() or not (at / "scorers" / "scorer_config.json").exists():
            export_checkpoint(run_dir, at, step)
        scorers[f"s{step}"] = scorers[f"s{step}_teacher"] = str(at / "scorers")
        students[f"s{step}"] = str(at / "student")
    ev = EvalConfig(mode="quality", model=teacher, out_dir=str(out / "eval"), testbed=cfg["data"]["testbed"],
                    split="test", num_problems=num_problems, batch_size=batch_size,
                    compressions=list(compressions), policies=["dense", *scorers], scorers=scorers,
                    students=students, plots=False)
    return run_quality(ev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvjax.evaluation.checkpoint_curve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, nargs="+", required=True, help="checkpoint steps (kept by the run)")
    ap.add_argument("--num-problems", type=int, default=128)
    ap.add_argument("--compressions", type=float, nargs="+", default=[0.75])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        res = checkpoint_curve(args.run_dir, args.steps, args.out, num_problems=args.num_problems,
                               compressions=args.compressions)
    except (FileNotFoundError, ValueError) as e:
        print(f"checkpoint_curve: {e}", file=sys.stderr)
        return 1
    from kvjax.evaluation.cli import _markdown

    table = _markdown(res["rows"])
    (Path(args.out) / "results.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
