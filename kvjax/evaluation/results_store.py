"""Per-problem evaluation records on disk, so an interrupted run resumes where it stopped.

``problems.jsonl`` holds one JSON record per evaluated (length, compression, policy,
problem); each batch's records are appended and flushed as soon as the batch finishes.
``fingerprint.json`` holds what the records depend on (model, testbed, split, scorer
files, ...). Reopening a folder with a different fingerprint is refused (results are never
mixed); a torn last line (a crash mid-write) is dropped and recomputed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def record_key(factor: int, compression: float, policy: str, index: int) -> str:
    return f"{factor}|{compression:g}|{policy}|{index}"


class ResultsStore:
    def __init__(self, directory, fingerprint: dict, resume: bool = True):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "problems.jsonl"
        fp_path = self.dir / "fingerprint.json"
        fingerprint = json.loads(json.dumps(fingerprint))   # normalise tuples, keys
        if not resume and self.path.exists():
            self.path.unlink()
        if self.path.exists() and fp_path.exists():
            old = json.loads(fp_path.read_text())
            if old != fingerprint:
                diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
                raise ValueError(f"{self.dir} already holds per-problem results of a different evaluation "
                                 f"(differs in: {', '.join(diff)}); use another out_dir, or --set resume=false "
                                 f"to discard them")
        tmp = fp_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
        os.replace(tmp, fp_path)
        self.records: dict[str, dict] = {}
        if self.path.exists():
            good = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break          # torn tail: everything from here is recomputed
                self.records[rec["key"]] = rec
                good.append(line)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(g + "\n" for g in good))
            os.replace(tmp, self.path)

    def has(self, keys) -> bool:
        return all(k in self.records for k in keys)

    def add(self, records: list[dict]) -> None:
        """Append the records whose keys are new (a batch rerun for its missing problems
        does not duplicate the ones already stored)."""
        records = [r for r in records if r["key"] not in self.records]
        with self.path.open("a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for rec in records:
            self.records[rec["key"]] = rec
