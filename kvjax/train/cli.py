"""Train with kvjax: ``python train.py --config configs/X.yaml [--set key=value ...]``.

Modes (``mode:`` in the config): ``pretrain`` (LM training, e.g. the testbed teacher),
``distill_kvpop``, ``distill_lkv``. Results land under ``out_dir``: ``config.json``,
``metrics.jsonl``, ``eval.jsonl``, ``checkpoints/``. Rerunning the same command resumes
from the latest checkpoint.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from kvjax.configio import cli_config
    from kvjax.train.config import TrainConfig

    def extra(ap):
        ap.add_argument("--dry-run", action="store_true", help="print the train state's shapes and per-device memory, "
                                                               "then exit")

    cfg, args = cli_config(TrainConfig, "train.py", __doc__, argv, extra, set_example="optim.lr=1e-3", examples=(
        "python train.py --config configs/testbed-distill-kvpop.yaml --dry-run",
        "python train.py --config configs/testbed-distill-kvpop.yaml --set steps=20 --set out_dir=runs/try-kvpop"))
    for w in cfg.warnings():
        print(f"train.py: warning: {w}", file=sys.stderr)
    from kvjax.configio import path_hint

    if args.dry_run:
        from kvjax.train.dry_run import dry_run

        try:
            print(dry_run(cfg))
        except (FileNotFoundError, ValueError, KeyError) as e:     # a missing model folder, ...: one line
            print(f"train.py: error: {e}" + (path_hint(args.config) if isinstance(e, FileNotFoundError) else ""),
                  file=sys.stderr)
            return 1
        return 0
    from kvjax.dir_lock import FolderInUse
    from kvjax.train.checkpoint import CheckpointError
    from kvjax.train.loop import train

    try:
        summary = train(cfg)
    except (CheckpointError, FolderInUse, FileNotFoundError, ValueError, KeyError) as e:
        # bad input found at run time (a missing or damaged file, a folder in use): one line, no traceback
        print(f"train.py: error: {e}" + (path_hint(args.config) if isinstance(e, FileNotFoundError) else ""),
              file=sys.stderr)
        return 1
    if "stopped_at" in summary:
        sig = summary.get("signal") or "a stop request"
        print(f"train.py: interrupted by {sig} at step {summary['stopped_at']} of {cfg.total_steps}; the checkpoint "
              f"is saved and the run is resumable: rerun the same command", file=sys.stderr)
        return 130 if sig == "SIGINT" else 0   # SIGTERM (preemption) is a clean save-and-exit
    m = summary.get("last_metrics", {})
    print(f"done: {summary['steps']} steps, final loss {m.get('loss', float('nan')):.4f}, results in {cfg.out_dir}")
    return 0
