"""pyproject.toml's ranges, not only constraints.txt's pins: no script folder shadows an installed
(or transformers-required) package, and the newest versions the ranges allow still resolve.

``python bench/X.py`` puts ``bench/`` first on ``sys.path``: a script named ``kernels.py`` there shadowed
the ``kernels`` package transformers 5.25 imports (``ImportError: cannot import name
'CUDAProperties' from 'kernels' (the script of that name)``), unseen under constraints.txt's
transformers 5.24. ``make test-latest`` runs the fast tests under the newest versions."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paths import ROOT, TESTS

# folders a script runs from (its folder goes first on sys.path) and what conftest.py puts there
SCRIPT_FOLDERS = ("bench", "experiments", ".", "tests")


def _module_names(folder: Path) -> dict[str, Path]:
    """``{importable top-level name: file or package folder}`` directly in ``folder``."""
    out = {}
    for p in folder.iterdir():
        if p.suffix == ".py":
            out[p.stem] = p
        elif p.is_dir() and (p / "__init__.py").is_file():
            out[p.name] = p
    return out


def _import_name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "_", distribution).lower()


def _ours() -> set[str]:
    """This project's own top-level packages (kvjax, pallas_kernels): they may sit at the root."""
    return {n for n, dists in importlib.metadata.packages_distributions().items() if set(dists) == {"kvjax"}}


def _transformers_requirements() -> set[str]:
    """Import names of every distribution transformers may require (any extra): a newer release
    can make one of them a hard dependency, as 5.25 did with ``kernels``."""
    try:
        reqs = importlib.metadata.requires("transformers") or []
    except importlib.metadata.PackageNotFoundError:
        reqs = []
    return {_import_name(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in reqs}


def _clashes(taken: set[str]) -> list[str]:
    ours = _ours()
    return sorted(f"{os.path.relpath(path, ROOT)} shadows the {name!r} package"
                  for folder in SCRIPT_FOLDERS for name, path in _module_names(Path(ROOT, folder)).items()
                  if name in taken and name not in ours)


def test_no_script_folder_module_shadows_a_package():
    taken = (set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
             | _transformers_requirements() | {"kernels"})
    assert not _clashes(taken), "rename them: " + "; ".join(_clashes(taken))


def _pip(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})


def _pins() -> dict[str, str]:
    out = {}
    for line in Path(ROOT, "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            out[_import_name(name)] = version.strip()
    return out


@pytest.mark.integration
def test_newest_versions_in_the_ranges_resolve(capsys):
    """``pip install --dry-run`` of ``.[test,real]`` without constraints.txt: the ranges resolve, and
    no package they pull in is shadowed by a script folder's module; prints what it would take."""
    try:
        probe = _pip("index", "versions", "transformers", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.skip("the package index did not answer within 60 s (offline?)")
    if probe.returncode != 0:
        pytest.skip(f"the package index cannot be reached: {probe.stderr.strip().splitlines()[-1:]}")
    wheels = ["--find-links", "/opt/wheels"] if os.path.isdir("/opt/wheels") else []   # Makefile's PIP_FLAGS
    t = time.time()
    res = _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-", *wheels, "-e", ".[test,real]",
               timeout=300)
    seconds = time.time() - t
    assert res.returncode == 0, "pyproject.toml's ranges do not resolve:\n" + res.stderr[-3000:]
    report = json.loads(res.stdout)
    resolved = {_import_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    assert {"jax", "flax", "transformers", "torch", "kvjax"} <= set(resolved)
    pins = _pins()
    with capsys.disabled():
        print(f"\nnewest versions in pyproject.toml's ranges ({seconds:.0f} s to resolve; constraints.txt's pin "
              "in brackets where it differs):")
        print("  " + ", ".join(f"{n} {v}" + (f" [{pins[n]}]" if n in pins and pins[n] != v.split("+")[0] else "")
                               for n, v in sorted(resolved.items()) if n != "kvjax"))
    assert not _clashes(set(resolved)), "; ".join(_clashes(set(resolved)))
