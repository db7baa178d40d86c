"""Gzip-compressed JSONL, the format of every result store: one gzip member per append, compacted
to one member (no time or name in its header: the same bytes every time), a torn tail dropped on
read. :class:`kvjax.evaluation.results_store.ResultsStore` keeps its records this way, and so does
``experiments/kvpress_compare.py``, which runs in kvpress's venv and loads this file by path:
standard library only, no kvjax import."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path


def gzip_member(text: str) -> bytes:
    """``text`` as one gzip member, no time or name in its header (the same bytes every time)."""
    return gzip.compress(text.encode(), compresslevel=6, mtime=0)


def stored_lines(path: Path, say=print) -> list[str]:
    """The complete non-empty lines of a ``.jsonl.gz`` store (gzip members) or of a plain
    ``.jsonl``; a torn tail (a crash mid-append) is dropped, with a message through ``say``."""
    path = Path(path)
    if not path.exists():
        return []
    if path.suffix != ".gz":
        text = path.read_text()
    else:
        parts = []
        try:
            with gzip.open(path, "rt") as f:
                for line in f:
                    parts.append(line)
        except (EOFError, OSError, zlib.error):
            say(f"dropping a torn tail of {path}")
        text = "".join(parts)
    lines = text.split("\n")
    if lines[-1]:
        say(f"dropping a torn last line of {path}")
    return [x for x in lines[:-1] if x.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a store, in file order, up to the first line that is not JSON (see
    :func:`stored_lines` for the torn tail)."""
    out = []
    for line in stored_lines(path, say=lambda m: None):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def compact(path: Path, lines) -> None:
    """``lines`` (JSON text, one record each) written to ``path`` as one gzip member, atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(gzip_member("".join(line + "\n" for line in lines)))
    os.replace(tmp, path)
