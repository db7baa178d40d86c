"""Every repository path the code, configs and documents cite names a file that exists
(``kvjax/...``, ``bench/...``, ``experiments/...``, ``docs/...``, ``configs/...``, ...)."""

import re
import subprocess

from pathlib import Path

from paths import ROOT as _ROOT

ROOT = Path(_ROOT)

TOP = ("kvjax", "pallas_kernels", "bench", "experiments", "docs", "configs", "assets", "tests", "results")
CITED = re.compile(r"(?<![\w./-])((?:%s)/(?:[\w-]+/)*[\w.-]+\.(?:py|md|yaml|sh|json))(?![\w/])" % "|".join(TOP))
PLACEHOLDER = re.compile(r"/(?:[A-Z]+|x|X|NAME|SCRIPT|no_such_script|longctx-x)\.\w+$")


def _tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if f.endswith((".py", ".md", ".yaml", ".sh")) or f == "Makefile"]


def test_every_cited_repository_file_exists():
    missing = {}
    for f in _tracked():
        if not f.exists():
            continue
        for m in CITED.finditer(f.read_text(errors="ignore")):
            path = m.group(1)
            if PLACEHOLDER.search(path) or (ROOT / path).exists():
                continue
            missing.setdefault(path, []).append(str(f.relative_to(ROOT)))
    assert not missing, f"cited but missing: {missing}"


def test_the_check_sees_a_missing_file(tmp_path):
    page = "docs/" + "no-such-page.md"          # spelled apart: this file is scanned too
    assert CITED.findall(f"see `{page}` and kvjax/decode.py") == [page, "kvjax/decode.py"]
    assert not (ROOT / page).exists()
