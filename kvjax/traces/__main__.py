"""``python -m kvjax.traces --config configs/traces-smollm2.yaml [--set key=value ...]``

Generates the model's own multi-turn reasoning traces into ``out_dir/{train,valid,test}.jsonl``
(resumable: run it again after a stop and it writes only what is missing), then prints
the length distribution and tokens/s (also in ``out_dir/summary.json``).
"""

import json
import sys

from kvjax.configio import cli_config
from kvjax.traces.run import TraceConfig, generate_traces


def main(argv=None) -> int:
    cfg, _ = cli_config(TraceConfig, "python -m kvjax.traces", __doc__, argv, set_example="num_traces=16", examples=(
        "python -m kvjax.traces --config configs/traces-smollm2.yaml --set num_traces=16 --set out_dir=runs/traces/try",))
    try:
        summary = generate_traces(cfg)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"python -m kvjax.traces: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
