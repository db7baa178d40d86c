"""pyproject.toml declares ranges (installable beside other packages); constraints.txt pins the
tested set, inside those ranges, and make installs with it."""

import os
import re
import tomllib

from packaging.requirements import Requirement
from paths import ROOT, TESTS  # noqa: F401



def _requirements():
    meta = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    reqs = [Requirement(r) for r in meta["dependencies"]]
    for extra in meta["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def _pins():
    pins = {}
    for line in open(os.path.join(ROOT, "constraints.txt")):
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_dependencies_are_ranges_not_exact_pins():
    for r in _requirements():
        assert not any(s.operator in ("==", "===") for s in r.specifier), f"{r} is an exact pin"
        assert r.specifier, f"{r} has no version range"


def test_constraints_pin_every_dependency_inside_its_range():
    pins = _pins()
    for r in _requirements():
        if r.extras:          # jax[tpu] / jax[cuda13]: platform extras, pinned through jax itself
            continue
        name = re.sub(r"[-_.]+", "-", r.name).lower()
        assert name in pins, f"constraints.txt does not pin {r.name}"
        assert r.specifier.contains(pins[name], prereleases=True), f"{r.name}=={pins[name]} is outside {r.specifier}"


def test_make_installs_with_the_constraints():
    make = open(os.path.join(ROOT, "Makefile")).read()
    assert "-c constraints.txt" in make and ".installed: pyproject.toml constraints.txt" in make
