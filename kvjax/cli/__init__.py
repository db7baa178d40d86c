"""``kvjax JOB [ARGS ...]``: one command for the library's jobs (also ``python -m kvjax``).

Each job forwards its arguments to the module that does the work (``kvjax longctx ARGS`` is
``python -m kvjax.longctx ARGS``), so ``kvjax JOB --help`` prints that module's own options,
followed by an example of the ``kvjax`` form. ``policies``, ``tasks`` and ``scorers`` list
what the library holds. ``bench`` and ``device-check`` run scripts of the repository's
``bench/`` folder, so they need a clone (see docs/cli.md).
"""

from __future__ import annotations

import difflib
import importlib
import subprocess
import sys
from dataclasses import dataclass

PROG = "kvjax"


@dataclass(frozen=True)
class Job:
    summary: str                    # one line for `kvjax --help`
    example: str                    # a command that works from the repository root
    module: str = ""                # forwarded: this module's main(argv)
    prefix: tuple[str, ...] = ()    # put before the forwarded arguments (scorer_fit's subcommand)
    run: str = ""                   # else: this function of kvjax.cli's own
    same: str = ""                  # the command it equals (default: python -m module prefix)

    def same_as(self) -> str:
        return self.same or " ".join(["python -m", self.module.removesuffix(".__main__"), *self.prefix])


JOBS: dict[str, Job] = {
    "real-model": Job("fetch SmolLM2-135M-Instruct once and convert it to a Hugging Face folder",
                      "kvjax real-model --check", "kvjax.real_model"),
    "traces": Job("generate the model's own multi-turn reasoning traces (train/valid/test)",
                  "kvjax traces --config configs/traces-smollm2.yaml --set num_traces=16 --set out_dir=runs/traces/try", "kvjax.traces.__main__"),
    "haystacks": Job("training long-context problems (seeds disjoint from the evaluation's) as trace splits",
                     "kvjax haystacks --set train=4 --set out_dir=runs/haystacks/try",
                     "kvjax.scorer_fit.__main__", ("haystacks",)),
    "features": Job("the teacher-feature pass over the traces (input of `fit`)",
                    "kvjax features --config configs/features-smollm2.yaml --set max_traces=8 --set out_dir=runs/features/try",
                    "kvjax.scorer_fit.__main__", ("features",)),
    "fit": Job("fit a KVpop scorer on those features and export it",
               "kvjax fit --config configs/scorers-smollm2.yaml --set features_dir=runs/features/try --set steps=20 "
               "--set out_dir=runs/scorers/try", "kvjax.scorer_fit.__main__",
               ("fit",)),
    "train": Job("pretrain a model or distil KVpop / LKV (same as python train.py)",
                 "kvjax train --config configs/testbed-distill-kvpop.yaml --dry-run", "kvjax.train.cli",
                 same="python train.py"),
    "evaluate": Job("testbed quality of every policy, or decode speed (same as python eval.py)",
                    'kvjax evaluate --config configs/testbed-quality.yaml --set "policies=[dense,snapkv,dms]" '
                    "--set num_problems=16 --set out_dir=runs/quality-try",
                    "kvjax.evaluation.cli", same="python eval.py"),
    "longctx": Job("long-context (RULER-style) accuracy of every policy on the real model",
                   "kvjax longctx --config configs/longctx-smollm2-quick.yaml", "kvjax.longctx.__main__"),
    "fidelity": Job("trace fidelity: top-1 agreement and KL to the dense model on its own traces",
                    "kvjax fidelity --config configs/fidelity-smollm2.yaml --set max_traces=4 --set out_dir=runs/fidelity/try",
                    "kvjax.evaluation.trace_fidelity"),
    "duo": Job("train DuoAttention's per-head gates and export them",
               "kvjax duo --config configs/duo-testbed.yaml --set steps=20 --set work_dir=runs/duo/try "
               "--set out_dir=runs/duo/try-export", "kvjax.duo.__main__"),
    "dms": Job("train DMS's per-head eviction decisions and export them",
               "kvjax dms --config configs/dms-testbed.yaml --set steps=20 --set work_dir=runs/dms/try "
               "--set out_dir=runs/dms/try-export", "kvjax.dms.__main__"),
    "kvpress-compare": Job("kvjax beside NVIDIA kvpress on the same problems (its own venv; a make target)",
                           "kvjax kvpress-compare --run", run="kvpress_compare"),
    "bench": Job("run a speed or memory script of the repository's bench/ folder",
                 "kvjax bench real_model_speed --batches 1 --new 32", run="bench"),
    "device-check": Job("the prepared accelerator check (bench/device_check.py)",
                        "kvjax device-check --smoke --out /tmp/dc", run="device_check"),
    "policies": Job("list every eviction policy and the budget it needs", "kvjax policies", run="policies"),
    "tasks": Job("list the long-context tasks", "kvjax tasks", run="tasks"),
    "scorers": Job("list the trained scorers shipped in assets/ (policy, model, budget)", "kvjax scorers",
                   run="scorers"),
}
LISTINGS = ("policies", "tasks", "scorers")


def usage() -> str:
    width = max(map(len, JOBS))
    lines = [f"usage: {PROG} JOB [ARGS ...]      {PROG} JOB --help: that job's options and an example", "",
             "Learned KV-cache eviction (KVpop, LKV) for JAX/Flax language models.", "", "jobs:"]
    lines += [f"  {name:<{width}}  {job.summary}" for name, job in JOBS.items() if name not in LISTINGS]
    lines += ["", "listings:"]
    lines += [f"  {name:<{width}}  {JOBS[name].summary}" for name in LISTINGS]
    lines += ["", "example:", "  kvjax real-model && kvjax longctx --config configs/longctx-smollm2-quick.yaml",
              "", "Config-driven jobs take --config FILE, --set key=value and --list-keys; see docs/cli.md."]
    return "\n".join(lines)


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _is_help(argv: list[str]) -> bool:
    return bool(argv) and argv[0] in ("-h", "--help")


def _forward(name: str, job: Job, argv: list[str]) -> int:
    main = importlib.import_module(job.module).main
    try:
        code = main([*job.prefix, *argv])
    except SystemExit as e:               # argparse's --help (0) and usage errors (2)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code == 0 and any(a in ("-h", "--help") for a in argv):
            print(f"\nexample ({PROG} {name} ARGS is {job.same_as()} ARGS):\n  {job.example}")
        return code
    return code or 0


def _script(folder: str, name: str, argv: list[str]) -> int:
    from kvjax.assets import checkout

    root = checkout()
    if root is None or not (root / folder).is_dir():
        return _error(f"{folder}/{name}.py ships with the git repository, not the installed package: clone "
                      f"kvjax and run {PROG} from the clone (pip install -e .)")
    script = root / folder / f"{name}.py"
    if not script.is_file():
        return _error(f"no script {folder}/{name}.py; {PROG} bench --help lists them")
    return subprocess.run([sys.executable, str(script), *argv]).returncode


def bench_scripts() -> dict[str, str]:
    """``{name: first docstring line}`` of each runnable script in the checkout's ``bench/``."""
    import ast

    from kvjax.assets import checkout

    root = checkout()
    out = {}
    for f in sorted((root / "bench").glob("*.py")) if root is not None else []:
        text = f.read_text()
        if '__name__ == "__main__"' in text:
            first = " ".join((ast.get_docstring(ast.parse(text)) or "").split("\n\n")[0].split())
            out[f.stem] = first if len(first) <= 110 else first[:107].rsplit(" ", 1)[0] + " ..."
    return out


def bench(argv: list[str]) -> int:
    if not argv or _is_help(argv):
        scripts = bench_scripts()
        lines = [f"usage: {PROG} bench SCRIPT [ARGS ...]   (runs python bench/SCRIPT.py ARGS from the repository "
                 f"checkout; {PROG} bench SCRIPT --help: its options)", ""]
        width = max(map(len, scripts), default=0)
        lines += ["scripts:", *(f"  {n:<{width}}  {d}" for n, d in scripts.items())] if scripts else [
            "no bench/ folder: the scripts ship with the git repository, not the installed package"]
        lines += ["", "example:", f"  {JOBS['bench'].example}"]
        print("\n".join(lines), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    return _script("bench", argv[0].removesuffix(".py"), argv[1:])


def device_check(argv: list[str]) -> int:
    if _is_help(argv):
        print(f"usage: {PROG} device-check [ARGS ...]   (python bench/device_check.py ARGS, from the repository "
              f"checkout)\n\nexample:\n  {JOBS['device-check'].example}      # tiny sizes on the CPU, < 3 min\n"
              f"  {PROG} device-check --out runs/device-check     # on a GPU/TPU\n\nits own options follow:\n",
              flush=True)
    return _script("bench", "device_check", argv)


KVPRESS = """usage: kvjax kvpress-compare [--run [MAKE_VARIABLE=VALUE ...]]

kvjax's long-context table beside NVIDIA kvpress's presses on the same tokenized problems.
kvpress pins other torch/transformers versions than kvjax, so it runs in its own virtual
environment (.venv-kvpress, made by experiments/kvpress_venv.sh) and the comparison is the Makefile
target `make kvpress-compare` of the repository checkout: it exports the problems
(python -m kvjax.longctx --export-problems), runs experiments/kvpress_compare.py in .venv-kvpress and
prints both sides (experiments/kvpress_side_by_side.py). About 80 minutes on 2 cores from scratch.

  --run    run that make target in the checkout (make variables may follow)

example (the quick slice):
  kvjax kvpress-compare --run LONGCTX=configs/longctx-smollm2-quick.yaml KVPRESS_SET= \\
      KVPRESS_OUT=runs/kvpress-quick KVJAX_STORE=runs/longctx/smollm2-quick"""


def kvpress_compare(argv: list[str]) -> int:
    if not argv or _is_help(argv):
        print(KVPRESS)
        return 0
    if argv[0] != "--run":
        return _error(f"kvpress-compare: unknown argument {argv[0]!r} (only --run [VAR=value ...])")
    from kvjax.assets import checkout

    root = checkout()
    if root is None or not (root / "Makefile").is_file():
        return _error("kvpress-compare is the Makefile target of the git repository: clone kvjax and run it there")
    return subprocess.run(["make", "-C", str(root), "kvpress-compare", *argv[1:]]).returncode


def _listing(name: str, argv: list[str]) -> int:
    from kvjax.cli import listings

    if _is_help(argv):
        print(f"usage: {PROG} {name}\n\n{getattr(listings, name).__doc__}\n\nexample:\n  {JOBS[name].example}")
        return 0
    if argv:
        return _error(f"{name} takes no arguments, got {' '.join(argv)}")
    return getattr(listings, name)(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or _is_help(argv):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    job = JOBS.get(name)
    if job is None:
        close = difflib.get_close_matches(name, JOBS, n=1)
        return _error(f"unknown job {name!r}" + (f" (did you mean {close[0]}?)" if close else "")
                      + f"; {PROG} --help lists them")
    if job.module:
        return _forward(name, job, rest)
    if name in LISTINGS:
        return _listing(name, rest)
    return globals()[job.run](rest)


__all__ = ["JOBS", "main", "usage"]
