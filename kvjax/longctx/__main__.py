"""``python -m kvjax.longctx --config configs/longctx-smollm2.yaml [--set key=value ...]``

Long-context quality (RULER-style tasks, bounded throughout) of every policy on the real
model; writes ``out_dir/table.md`` and ``out_dir/summary.json`` and prints the table.
"""

import json
import sys
from pathlib import Path

from kvjax.configio import cli_config
from kvjax.longctx.run import LongCtxConfig, markdown, run_longctx, to_json


def main(argv=None) -> int:
    cfg, _ = cli_config(LongCtxConfig, "python -m kvjax.longctx", __doc__, argv)
    try:
        tab = run_longctx(cfg)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"python -m kvjax.longctx: {e}", file=sys.stderr)
        return 1
    names = list(dict.fromkeys(["dense", *cfg.policies, *cfg.learned]))
    md = markdown(tab, cfg, names)
    out = Path(cfg.out_dir)
    (out / "table.md").write_text(md + "\n")
    (out / "summary.json").write_text(json.dumps(to_json(tab), indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
