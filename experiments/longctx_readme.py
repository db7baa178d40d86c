"""Refresh the README's headline long-context table and docs/real-model.md's full tables from
the committed store (runs nothing; can run while the table is being computed).

    python experiments/longctx_readme.py [--config configs/longctx-smollm2-compressed.yaml]

Writes the store folder's ``table.md``, ``summary.json`` and figures (``python -m kvjax.longctx
--report``), copies the figures to ``docs/figures/smollm2-longctx-compressed-*.png``, and
replaces the text between the ``<!-- longctx overview ... -->`` / ``<!-- /longctx overview -->``
markers of README.md (the overview table, the problems per task and who wins where) and between the
``<!-- longctx tables ... -->`` markers of docs/real-model.md (every table).
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def replace_between(path: Path, name: str, body: str) -> None:
    text = path.read_text()
    pat = re.compile(rf"(<!-- {name}[^\n]*-->\n).*?(<!-- /{name} -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"longctx_readme: {path} has no '<!-- {name} ... -->' / '<!-- /{name} -->' markers")
    path.write_text(pat.sub(lambda m: m.group(1) + body.strip() + "\n" + m.group(2), text, count=1))


def main(argv=None) -> None:
    from kvjax.configio import load_config
    from kvjax.longctx.__main__ import main as longctx
    from kvjax.longctx.run import LongCtxConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/longctx-smollm2-compressed.yaml"))
    args = ap.parse_args(argv)

    cfg = load_config(LongCtxConfig, args.config, [])
    if longctx(["--config", args.config, "--report"]) != 0:
        raise SystemExit("longctx_readme: the report failed")
    out = ROOT / cfg.out_dir
    table = (out / "table.md").read_text()
    overview = re.split(r"\n\n\*\*\d", table, maxsplit=1)[0]      # the overview and who wins where
    replace_between(ROOT / "README.md", "longctx overview", overview)
    replace_between(ROOT / "docs/real-model.md", "longctx tables", table)
    for src, dst in (("accuracy_vs_compression.png", "accuracy"), ("needle_heatmap.png", "needles")):
        shutil.copyfile(out / src, ROOT / f"docs/figures/smollm2-longctx-compressed-{dst}.png")
    print("README.md, docs/real-model.md and docs/figures updated")


if __name__ == "__main__":
    main()
