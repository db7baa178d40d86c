"""``python -m kvjax.duo --config configs/duo-smollm2.yaml [--set key=value ...]``: optimise
DuoAttention's per-head gates on passkey sequences (resumable) and export them; prints a JSON
summary (the gates and the loss at the first and last step)."""

import json
import sys

from kvjax.configio import cli_config
from kvjax.duo.train import DuoConfig, run_duo


def main(argv=None) -> int:
    cfg, _ = cli_config(DuoConfig, "python -m kvjax.duo", __doc__, argv, set_example="steps=20", examples=(
        "python -m kvjax.duo --config configs/duo-testbed.yaml --set steps=20 --set work_dir=runs/duo/try "
        "--set out_dir=runs/duo/try-export",))
    try:
        out = run_duo(cfg)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"python -m kvjax.duo: {e}", file=sys.stderr)
        return 1
    h = out["history"]
    print(json.dumps({"out_dir": out["out_dir"], "steps": len(h), "first": h[0], "last": h[-1],
                      "gates": [[round(x, 3) for x in row] for row in out["gates"]]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
