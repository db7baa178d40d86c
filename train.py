#!/usr/bin/env python
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

    cfg, args = cli_config(TrainConfig, "train.py", __doc__, argv, lambda ap: ap.add_argument(
        "--dry-run", action="store_true", help="print the train state's shapes and per-device memory, then exit"))
    if args.dry_run:
        from kvjax.train.dry_run import dry_run

        print(dry_run(cfg))
        return 0
    from kvjax.train.checkpoint import CheckpointError
    from kvjax.train.loop import train

    try:
        summary = train(cfg)
    except CheckpointError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1
    m = summary.get("last_metrics", {})
    print(f"done: {summary.get('steps', summary.get('stopped_at'))} steps, final loss {m.get('loss', float('nan')):.4f}, "
          f"results in {cfg.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
