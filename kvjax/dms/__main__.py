"""``python -m kvjax.dms --config configs/dms-smollm2.yaml [--set key=value ...]``: train DMS's
per-head eviction decisions on the model's own traces by distillation (resumable) and export
them; prints a JSON summary ([loss, KL, eviction rate] at the first and last step)."""

import json
import sys

from kvjax.configio import cli_config
from kvjax.dms.train import DMSConfig, run_dms


def main(argv=None) -> int:
    cfg, _ = cli_config(DMSConfig, "python -m kvjax.dms", __doc__, argv, set_example="steps=20", examples=(
        "python -m kvjax.dms --config configs/dms-testbed.yaml --set steps=20 --set work_dir=runs/dms/try "
        "--set out_dir=runs/dms/try-export",))
    try:
        out = run_dms(cfg)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"python -m kvjax.dms: {e}", file=sys.stderr)
        return 1
    h = out["history"]
    mem = {k: v for k, v in (out["ragged_memory"] or {}).items() if k != "kept_fraction_by_head"}
    print(json.dumps({"out_dir": out["out_dir"], "steps": len(h), "first": h[0], "last": h[-1], "ragged_memory": mem},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
