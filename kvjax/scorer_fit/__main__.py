"""``python -m kvjax.scorer_fit features|fit --config X.yaml [--set key=value ...]``

``features``: the teacher-feature pass over the trace splits (resumable).
``fit``: a scorer-only KVpop fit on those features, evaluated on the valid split and
exported as ``out_dir/export`` (``kvjax.load_scorers`` reads it). Both print a JSON summary.
"""

import json
import sys

from kvjax.configio import cli_config
from kvjax.scorer_fit.features import FeatureConfig, build_features
from kvjax.scorer_fit.fit import FitConfig, fit_scorers

COMMANDS = {"features": (FeatureConfig, build_features), "fit": (FitConfig, fit_scorers)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m kvjax.scorer_fit {{{'|'.join(COMMANDS)}}} --config X.yaml [--set key=value ...]",
              file=sys.stderr)
        return 2
    schema, run = COMMANDS[argv[0]]
    cfg, _ = cli_config(schema, f"python -m kvjax.scorer_fit {argv[0]}", __doc__, argv[1:])
    try:
        summary = run(cfg)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"python -m kvjax.scorer_fit {argv[0]}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in summary.items() if k != "valid"} | (
        {"valid": {k: v for k, v in summary["valid"].items() if not k.endswith("by_head")}} if "valid" in summary else {}),
        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
