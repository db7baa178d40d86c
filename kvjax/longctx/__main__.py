"""``python -m kvjax.longctx --config configs/longctx-smollm2.yaml [--set key=value ...]``

Long-context quality (RULER-style tasks, in the configured compression setting) of every policy on the real
model; writes ``out_dir/table.md``, ``out_dir/summary.json`` and two figures (accuracy vs
compression per task, the needle heatmap) and prints the table.
``--export-problems FILE`` writes the config's problems as token ids instead (the input of
``experiments/kvpress_compare.py``) and evaluates nothing. ``--report`` writes the table and figures
of what ``out_dir`` holds so far (problems with every record only) and runs nothing: it can be
run while the evaluation adds to that folder.
"""

import json
import sys
from pathlib import Path

from kvjax.configio import cli_config, path_hint
from kvjax.longctx.report import markdown, report
from kvjax.longctx.run import LongCtxConfig, run_longctx, to_json


PROG = "python -m kvjax.longctx"


def resume_command(argv) -> str:
    """The command that resumes this run: the same arguments."""
    import shlex

    return shlex.join(["python", "-m", "kvjax.longctx", *argv])


def main(argv=None) -> int:
    cfg, args = cli_config(LongCtxConfig, PROG, __doc__, argv, set_example="problems=8", examples=(
                               f"{PROG} --config configs/longctx-smollm2-quick.yaml --set problems=2 "
                               "--set out_dir=runs/longctx/try",
                               f"{PROG} --config configs/longctx-smollm2-compressed.yaml --report"),
                           extra=lambda ap: (ap.add_argument("--export-problems", metavar="FILE",
                                                             help="write the problems as token ids and stop"),
                                             ap.add_argument("--report", action="store_true",
                                                             help="table and figures of the stored records; "
                                                                  "runs nothing")))
    if args.export_problems:
        import transformers

        from kvjax.longctx.run import export_problems
        from kvjax.real_model import ensure_model

        tok = transformers.AutoTokenizer.from_pretrained(cfg.model_dir or ensure_model())
        print(f"wrote {export_problems(cfg, args.export_problems, tok)} problems to {args.export_problems}")
        return 0
    try:
        if args.report:
            tab = report(cfg)
            print("complete problems per task: " + "; ".join(
                f"{L}: " + ", ".join(f"{t} {n}" for t, n in tasks.items()) for L, tasks in tab["complete"].items()))
        else:
            tab = run_longctx(cfg)
    except KeyboardInterrupt:
        # every finished batch's records are on disk (ResultsStore appends and fsyncs each batch);
        # the batch under way is recomputed, a torn last line dropped on resume
        print(f"\n{PROG}: interrupted; every finished batch is stored in {cfg.out_dir}, nothing stored is lost, "
              f"and the run is resumable: {resume_command(sys.argv[1:] if argv is None else argv)}", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        hint = path_hint(args.config) if isinstance(e, FileNotFoundError) else ""
        print(f"{PROG}: {e}{hint}", file=sys.stderr)
        return 1
    names = list(dict.fromkeys(["dense", *cfg.policies, *cfg.learned]))
    md = markdown(tab, cfg, names)
    out = Path(cfg.out_dir)
    (out / "table.md").write_text(md + "\n")
    (out / "summary.json").write_text(json.dumps(to_json(tab), indent=1))
    # which config wrote this table: results_store's merge prints the --report command that rewrites it
    (out / "report.json").write_text(json.dumps({"config": args.config,
                                                 "set": [s for s in args.set if not s.startswith("out_dir=")]}))
    print(md)
    from kvjax.longctx.plots import write_figures
    from kvjax.longctx.run import SETTING

    for path in write_figures(tab["records"], tab["average"], list(cfg.learned), cfg.compressions, out,
                              SETTING[cfg.prefill].split(" (")[0]):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
