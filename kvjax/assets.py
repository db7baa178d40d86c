"""Where the repository's shipped files are: the trained scorers, traces and testbed teachers
under ``assets/``, and the ``bench/`` scripts.

They ship with the git repository, not inside the ``kvjax`` package: a checkout installed with
``pip install -e .`` finds them beside the package; a non-editable install (a wheel) does not
hold them, so set ``KVJAX_ASSETS`` to the ``assets`` folder of a clone.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "KVJAX_ASSETS"
REPOSITORY = "the git repository of kvjax"


class AssetsNotFound(FileNotFoundError):
    """No assets folder: neither ``KVJAX_ASSETS`` nor a repository checkout beside the package."""


def checkout() -> Path | None:
    """The repository folder kvjax is imported from (a clone, editable install or not), else
    ``None`` (a non-editable install: the package sits in ``site-packages`` alone)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else None


def assets_dir() -> Path:
    """The shipped ``assets`` folder: ``$KVJAX_ASSETS`` if set, else ``assets/`` of the checkout
    beside the package; :class:`AssetsNotFound` (one line saying what to do) if neither exists."""
    env = os.environ.get(ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise AssetsNotFound(f"{ENV}={env} is not a folder: point it at the assets/ folder of a kvjax clone")
        return path
    root = checkout()
    if root is not None and (root / "assets").is_dir():
        return root / "assets"
    raise AssetsNotFound(f"no kvjax assets folder: the shipped scorers and traces come with {REPOSITORY}, not the "
                         f"installed package; clone it (and pip install -e it) or set {ENV} to the clone's assets/ "
                         f"folder")


def asset(*parts: str) -> Path:
    """``assets_dir() / parts``, e.g. ``asset("smollm2-scorers", "kvpop-mlp-mean")``; raises
    :class:`AssetsNotFound` when that entry is missing."""
    path = assets_dir().joinpath(*parts)
    if not path.exists():
        raise AssetsNotFound(f"{path}: not in the assets folder ({ENV} or the repository checkout)")
    return path


__all__ = ["ENV", "AssetsNotFound", "checkout", "assets_dir", "asset"]
