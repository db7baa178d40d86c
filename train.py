#!/usr/bin/env python
"""Train with kvjax: ``python train.py --config configs/X.yaml [--set key=value ...]``.

Modes (``mode:`` in the config): ``pretrain`` (LM training, e.g. the testbed teacher),
``distill_kvpop``, ``distill_lkv``. Results land under ``out_dir``: ``config.json``,
``metrics.jsonl``, ``eval.jsonl``, ``checkpoints/``. Rerunning the same command resumes
from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (dotted path), e.g. --set optim.lr=1e-3")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the train state's shapes and per-device memory, then exit")
    args = ap.parse_args(argv)

    from kvjax.configio import ConfigError, load_config
    from kvjax.train.config import TrainConfig

    try:
        cfg = load_config(TrainConfig, args.config, args.set)
    except (ConfigError, FileNotFoundError) as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from kvjax.train.dry_run import dry_run

        print(dry_run(cfg))
        return 0
    from kvjax.train.loop import train

    summary = train(cfg)
    m = summary.get("last_metrics", {})
    print(f"done: {summary.get('steps', summary.get('stopped_at'))} steps, final loss {m.get('loss', float('nan')):.4f}, "
          f"results in {cfg.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
