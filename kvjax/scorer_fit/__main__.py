"""``python -m kvjax.scorer_fit haystacks|features|fit --config X.yaml [--set key=value ...]``

``haystacks``: training long-context problems (seeds disjoint from the evaluation's) written
as trace splits, for the feature pass to read (``traces_dir``).
``features``: the teacher-feature pass over the trace splits (resumable).
``fit``: a scorer-only KVpop fit on those features, evaluated on the valid split and
exported as ``out_dir/export`` (``kvjax.load_scorers`` reads it). Both print a JSON summary.
"""

import json
import sys

from kvjax.configio import cli_config
from kvjax.scorer_fit.features import FeatureConfig, build_features
from kvjax.scorer_fit.fit import FitConfig, fit_scorers
from kvjax.scorer_fit.haystacks import HaystackConfig, write_haystacks

COMMANDS = {"haystacks": (HaystackConfig, write_haystacks), "features": (FeatureConfig, build_features),
            "fit": (FitConfig, fit_scorers)}
PROG = "python -m kvjax.scorer_fit"
EXAMPLES = {"haystacks": ("train=4", f"{PROG} haystacks --set train=4 --set out_dir=runs/haystacks/try"),
            "features": ("max_traces=8", f"{PROG} features --config configs/features-smollm2.yaml --set max_traces=8 "
                                         "--set out_dir=runs/features/try"),
            "fit": ("steps=20", f"{PROG} fit --config configs/scorers-smollm2.yaml --set features_dir=runs/features/try "
                                "--set steps=20 --set out_dir=runs/scorers/try")}
USAGE = f"""usage: {PROG} {{haystacks,features,fit}} [--config X.yaml] [--set key=value ...] [--list-keys]

A KVpop scorer fitted on the model's own traces (python -m kvjax.traces) or on training
haystacks, in two steps (three with haystacks):

commands:
  haystacks training long-context problems, seeds disjoint from the evaluation's, written as
            trace splits (train.jsonl, valid.jsonl) for features' traces_dir
  features  the teacher-feature pass over the trace splits: each trace's per-layer [k; v] and
            targets (future attention, reconstruction), once, memory-mapped (resumable)
  fit       a scorer-only KVpop fit on those features, evaluated on the valid split and exported
            as out_dir/export (kvjax.load_scorers reads it)

Both print a JSON summary. {PROG} COMMAND --help: that command's options.

examples:
  {EXAMPLES["haystacks"][1]}
  {EXAMPLES["features"][1]}
  {EXAMPLES["fit"][1]}"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"{PROG}: error: unknown command {argv[0]!r}: choose haystacks, features or fit ({PROG} --help)", file=sys.stderr)
        return 2
    schema, run = COMMANDS[argv[0]]
    set_example, example = EXAMPLES[argv[0]]
    cfg, _ = cli_config(schema, f"{PROG} {argv[0]}", __doc__, argv[1:], set_example=set_example, examples=(example,))
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
