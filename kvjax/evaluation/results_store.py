"""Per-problem evaluation records on disk, so an interrupted run resumes where it stopped.

``problems.jsonl`` holds one JSON record per evaluated (length, compression, policy,
problem); each batch's records are appended and flushed as soon as the batch finishes.
``fingerprint.json`` holds what the records depend on: ``run`` (model, testbed, split,
...), shared by every record, and ``policies`` (per policy label: its scorer and student
files). Reopening a folder whose ``run`` part differs is refused (results are never mixed);
when only some policies' parts differ (a retrained scorer), just those policies' records
are discarded and recomputed; policies this run does not evaluate keep their records and
their stored fingerprint (a run over a subset of policies loses nothing). A torn last line
(a crash mid-write) is dropped and recomputed. A folder serves one evaluation at a time
(``.lock``); a second is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvjax.dir_lock import DirLock


def folder_digest(folder) -> str:
    """A short digest of every file in ``folder`` (names and bytes): a scorer's fingerprint."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(folder).iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def record_key(factor: int, compression: float, policy: str, index: int) -> str:
    return f"{factor}|{compression:g}|{policy}|{index}"


def policy_of(key: str) -> str:
    return key.split("|")[2]


def _split_legacy(old: dict) -> dict:
    """A fingerprint written before the run / policies split: scorers and students were
    run-wide maps ``{label: [path, digest]}``."""
    if "run" in old:
        return old
    policies: dict[str, dict] = {}
    for part, field in (("scorers", "scorer"), ("students", "student")):
        for label, entry in old.get(part, {}).items():
            policies.setdefault(label, {})[field] = entry
    return {"run": {k: v for k, v in old.items() if k not in ("scorers", "students")}, "policies": policies}


class ResultsStore:
    def __init__(self, directory, run: dict, resume: bool = True, policies: dict | None = None):
        """``run``: what every record depends on; ``policies``: ``{label: what that policy's
        records also depend on}`` for the policies of this run (a label not listed keeps
        whatever the folder's fingerprint says about it)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        # one evaluation per folder at a time: a second one would rewrite problems.jsonl under
        # the first one's appends (its records would go to the replaced file and be lost)
        self._lock = DirLock(self.dir, "evaluation")
        try:
            self._load(run, resume, policies)
        except BaseException:
            self._lock.release()
            raise

    def _load(self, run: dict, resume: bool, policies: dict | None) -> None:
        self.path = self.dir / "problems.jsonl"
        fp_path = self.dir / "fingerprint.json"
        fingerprint = json.loads(json.dumps({"run": run, "policies": policies or {}}))   # normalise tuples, keys
        if not resume and self.path.exists():
            self.path.unlink()
        stale: set[str] = set()
        if self.path.exists() and fp_path.exists():
            old = _split_legacy(json.loads(fp_path.read_text()))
            if old["run"] != fingerprint["run"]:
                o, n = old["run"], fingerprint["run"]
                diff = sorted(k for k in set(o) | set(n) if o.get(k) != n.get(k))
                raise ValueError(f"{self.dir} already holds per-problem results of a different evaluation "
                                 f"(differs in: {', '.join(diff)}); use another out_dir, or --set resume=false "
                                 f"to discard them")
            o, n = old["policies"], fingerprint["policies"]
            stale = {p for p in n if o.get(p) != n[p]}
            fingerprint["policies"] = {**o, **n}
        tmp = fp_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
        os.replace(tmp, fp_path)
        self.records: dict[str, dict] = {}
        self.discarded: dict[str, int] = {}   # policy -> records dropped because its files changed
        if self.path.exists():
            good: dict[str, str] = {}      # key -> its last line: a key written twice is kept once
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break          # torn tail: everything from here is recomputed
                if (policy := policy_of(rec["key"])) in stale:
                    self.discarded[policy] = self.discarded.get(policy, 0) + 1
                    continue
                self.records[rec["key"]] = rec
                good[rec["key"]] = line
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(g + "\n" for g in good.values()))
            os.replace(tmp, self.path)

    def close(self) -> None:
        """Release the folder for another evaluation (also done when the process exits)."""
        self._lock.release()

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


def read_fingerprint(folder) -> dict:
    """``{"run", "policies"}`` of a results folder (legacy fingerprints split)."""
    path = Path(folder) / "fingerprint.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no fingerprint.json (not a results folder)")
    return _split_legacy(json.loads(path.read_text()))


def merge_into(dst, src) -> int:
    """Append ``src``'s records that ``dst`` lacks, so two runs of one evaluation on disjoint
    work (e.g. one length each, in two processes) end in one folder. Refused unless both
    folders hold the same evaluation (``run``) and every policy both hold has the same
    fingerprint; both folders are locked meanwhile. Returns the number of records added."""
    fd, fs = read_fingerprint(dst), read_fingerprint(src)
    if fd["run"] != fs["run"]:
        diff = sorted(k for k in set(fd["run"]) | set(fs["run"]) if fd["run"].get(k) != fs["run"].get(k))
        raise ValueError(f"{src} and {dst} hold different evaluations (differ in: {', '.join(diff)})")
    clash = sorted(p for p in fs["policies"] if p in fd["policies"] and fs["policies"][p] != fd["policies"][p])
    if clash:
        raise ValueError(f"{src} and {dst} evaluated {', '.join(clash)} with different files (scorers)")
    source = ResultsStore(src, fs["run"], policies=fs["policies"])
    try:
        target = ResultsStore(dst, fd["run"], policies=fs["policies"])
        try:
            new = [r for k, r in source.records.items() if k not in target.records]
            target.add(new)
            return len(new)
        finally:
            target.close()
    finally:
        source.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvjax.evaluation.results_store",
                                 description="Merge one results folder's records into another (same evaluation).")
    ap.add_argument("src", help="the folder whose records are added")
    ap.add_argument("dst", help="the folder that receives them")
    a = ap.parse_args()
    try:
        print(f"added {merge_into(a.dst, a.src)} records of {a.src} to {a.dst}")
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"python -m kvjax.evaluation.results_store: {e}")
