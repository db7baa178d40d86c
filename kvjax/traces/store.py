"""Trace files: one JSONL per split, appended a whole batch at a time, resumable.

Each line is ``{"id", "kind", "split", "tokens", "prompt_len", "turns", "new_tokens"}``;
``data.source: tokens`` in a train config reads the ``tokens`` of every line. A kill can
leave at most one torn last line per file: :meth:`TraceStore.open` cuts it off, so the
lines on disk are always whole traces, each id at most once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvjax.dir_lock import DirLock

SPLITS = ("train", "valid", "test")


class TraceStore:
    def __init__(self, out_dir: str | os.PathLike):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = DirLock(self.dir, "trace run")
        self.done: dict[str, str] = {}            # id -> split
        for split in SPLITS:
            for row in self._read_whole_lines(self.path(split)):
                if row["id"] in self.done:
                    raise ValueError(f"{self.path(split)}: trace {row['id']!r} appears twice")
                self.done[row["id"]] = split

    def path(self, split: str) -> Path:
        return self.dir / f"{split}.jsonl"

    @staticmethod
    def _read_whole_lines(path: Path) -> list[dict]:
        """Rows of ``path``; a torn last line (no newline, or not JSON) is cut off the file."""
        if not path.exists():
            return []
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1
        rows = []
        for n, line in enumerate(data[:keep].splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise ValueError(f"{path}: line {n} is not JSON; the file is damaged") from None
        if keep < len(data):
            with open(path, "r+b") as f:
                f.truncate(keep)
        return rows

    def append(self, rows: list[dict]) -> None:
        """Write ``rows`` (each with its ``split``), one write and fsync per split file."""
        by_split: dict[str, list[dict]] = {}
        for r in rows:
            if r["id"] in self.done:
                continue
            by_split.setdefault(r["split"], []).append(r)
        for split, items in by_split.items():
            blob = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in items).encode()
            with open(self.path(split), "ab") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            self.done.update({r["id"]: split for r in items})

    def rows(self, split: str) -> list[dict]:
        return self._read_whole_lines(self.path(split))

    def close(self) -> None:
        self._lock.release()
