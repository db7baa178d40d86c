"""Per-problem evaluation records on disk, so an interrupted run resumes where it stopped.

``problems.jsonl.gz`` holds one JSON record per evaluated (length, compression, policy,
problem), gzip-compressed (about 15x smaller than the text: a committed table stays small and
resumable); each batch's records are appended as a gzip member and flushed as soon as the
batch finishes, and the file is rewritten as one member when the store opens and closes. A
folder written before (``problems.jsonl``) is read and converted on open. Read a folder's
records with :func:`read_records`.
``fingerprint.json`` holds what the records depend on: ``run`` (model, testbed, split,
...), shared by every record, and ``policies`` (per policy label: its scorer and student
files). Reopening a folder whose ``run`` part differs is refused (results are never mixed);
when only some policies' parts differ (a retrained scorer), just those policies' records
are discarded and recomputed; policies this run does not evaluate keep their records and
their stored fingerprint (a run over a subset of policies loses nothing). A torn tail
(a crash mid-write) is dropped and recomputed. A folder serves one evaluation at a time
(``.lock``, removed on close); a second is refused.

``python -m kvjax.evaluation.results_store SRC DST`` merges SRC's records into DST (a new folder
too) and marks DST's ``table.md`` stale, printing the ``--report`` command that rewrites it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvjax.dir_lock import DirLock
from kvjax.evaluation.jsonl_gz import compact, gzip_member, read_jsonl, stored_lines

STORE = "problems.jsonl.gz"      # the records of a results folder
LEGACY_STORE = "problems.jsonl"  # the same, uncompressed (folders written before)


def store_file(folder) -> Path:
    """The records file of a results folder: ``problems.jsonl.gz``, or a legacy ``problems.jsonl``."""
    folder = Path(folder)
    return folder / LEGACY_STORE if not (folder / STORE).exists() and (folder / LEGACY_STORE).exists() \
        else folder / STORE


def read_records(folder) -> list[dict]:
    """Every record of a results folder, in file order (a torn tail dropped)."""
    return read_jsonl(store_file(folder))


def load_learned(folders: dict, model) -> tuple[dict, dict]:
    """``(label -> policy, label -> {"scorer": the folder's digest})`` for exported scorer folders
    (``kvjax.load_scorers``, checked against ``model``): the learned rows of every runner and the
    fingerprints its store keeps for them."""
    from kvjax.export import load_scorers

    learned = {label: load_scorers(d, model=model) for label, d in folders.items()}
    return learned, {label: {"scorer": folder_digest(d)} for label, d in folders.items()}


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
        self._appended = False
        # one evaluation per folder at a time: a second one would rewrite problems.jsonl under
        # the first one's appends (its records would go to the replaced file and be lost)
        self._lock = DirLock(self.dir, "evaluation")
        try:
            self._load(run, resume, policies)
        except BaseException:
            self._lock.release()
            raise

    def _load(self, run: dict, resume: bool, policies: dict | None) -> None:
        self.path = self.dir / STORE
        source = store_file(self.dir)                 # a legacy problems.jsonl is converted below
        fp_path = self.dir / "fingerprint.json"
        fingerprint = json.loads(json.dumps({"run": run, "policies": policies or {}}))   # normalise tuples, keys
        if not resume:
            for f in (self.path, self.dir / LEGACY_STORE):
                f.unlink(missing_ok=True)
        stale: set[str] = set()
        if source.exists() and fp_path.exists():
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
        if source.exists():
            good: dict[str, str] = {}      # key -> its last line: a key written twice is kept once
            for line in stored_lines(source, say=lambda m: None):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break          # torn tail: everything from here is recomputed
                if (policy := policy_of(rec["key"])) in stale:
                    self.discarded[policy] = self.discarded.get(policy, 0) + 1
                    continue
                self.records[rec["key"]] = rec
                good[rec["key"]] = line
            self._lines = good
            compact(self.path, good.values())
            if source != self.path:
                source.unlink()
        else:
            self._lines = {}

    def close(self) -> None:
        """Compact the store into one gzip member and release the folder for another evaluation
        (the lock is also released when the process exits)."""
        try:
            if self._appended:
                compact(self.path, self._lines.values())
        finally:
            self._lock.release()

    def has(self, keys) -> bool:
        return all(k in self.records for k in keys)

    def add(self, records: list[dict]) -> None:
        """Append the records whose keys are new (a batch rerun for its missing problems
        does not duplicate the ones already stored)."""
        records = [r for r in records if r["key"] not in self.records]
        if not records:
            return
        lines = [json.dumps(rec) for rec in records]
        with self.path.open("ab") as f:                  # one gzip member per batch
            f.write(gzip_member("".join(line + "\n" for line in lines)))
            f.flush()
            os.fsync(f.fileno())
        self._appended = True
        for rec, line in zip(records, lines):
            self.records[rec["key"]] = rec
            self._lines[rec["key"]] = line


def read_fingerprint(folder) -> dict:
    """``{"run", "policies"}`` of a results folder (legacy fingerprints split)."""
    path = Path(folder) / "fingerprint.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no fingerprint.json (not a results folder)")
    return _split_legacy(json.loads(path.read_text()))


def _is_new(folder: Path) -> bool:
    """A destination that does not exist yet, or holds nothing (a stale ``.lock`` apart)."""
    return not folder.exists() or (folder.is_dir() and all(p.name == ".lock" for p in folder.iterdir()))


def merge_into(dst, src) -> int:
    """Append ``src``'s records that ``dst`` lacks, so two runs of one evaluation on disjoint
    work (e.g. one length each, in two processes) end in one folder. Refused unless both
    folders hold the same evaluation (``run``) and every policy both hold has the same
    fingerprint; both folders are locked meanwhile. A new (missing or empty) ``dst`` takes
    ``src``'s fingerprint. Returns the number of records added."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve() or (src.exists() and dst.exists() and os.path.samefile(src, dst)):
        raise ValueError(f"{src} and {dst} are the same folder: nothing to merge (name the folder whose "
                         "records are added first, then the folder that receives them)")
    fs = read_fingerprint(src)
    fd = fs if _is_new(dst) else read_fingerprint(dst)     # a new folder: src's fingerprint
    if fd["run"] != fs["run"]:
        diff = sorted(k for k in set(fd["run"]) | set(fs["run"]) if fd["run"].get(k) != fs["run"].get(k))
        raise ValueError(f"{src} and {dst} hold different evaluations (differ in: {', '.join(diff)})")
    clash = sorted(p for p in fs["policies"] if p in fd["policies"] and fs["policies"][p] != fd["policies"][p])
    if clash:
        raise ValueError(f"{src} and {dst} evaluated {', '.join(clash)} with different files (scorers)")
    new_dst = _is_new(dst)
    source = ResultsStore(src, fs["run"], policies=fs["policies"])
    try:
        target = ResultsStore(dst, fd["run"], policies=fs["policies"])
        if new_dst and (src / "report.json").is_file():     # which config wrote the records (longctx)
            (dst / "report.json").write_text((src / "report.json").read_text())
        try:
            new = [r for k, r in source.records.items() if k not in target.records]
            target.add(new)
            return len(new)
        finally:
            target.close()
    finally:
        source.close()


STALE = "**Stale:** records were merged into this folder after this table was written; regenerate it:"


def report_command(dst) -> str:
    """The command that rewrites ``dst``'s table and figures from its records: for a long-context
    store, ``python -m kvjax.longctx --config C --set out_dir=DST --report`` with the config its
    last run recorded in ``report.json``."""
    import shlex

    dst = Path(dst)
    info = dst / "report.json"
    config = json.loads(info.read_text()).get("config") if info.is_file() else _shipped_config_for(dst)
    if config:
        return shlex.join(["python", "-m", "kvjax.longctx", "--config", str(config), "--set",
                           f"out_dir={dst}", "--report"])
    return f"the command that wrote {dst / 'table.md'}, with --report (e.g. python -m kvjax.longctx " \
           f"--config <its config> --set out_dir={dst} --report)"


def _shipped_config_for(dst: Path) -> str | None:
    """The shipped long-context config (``configs/longctx-*.yaml``) whose ``out_dir`` is ``dst``
    (a store written before ``report.json``), as a path from the current directory."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    for c in sorted((root / "configs").glob("longctx-*.yaml")):
        try:
            out = (yaml.safe_load(c.read_text()) or {}).get("out_dir")
        except (yaml.YAMLError, AttributeError):
            continue
        if out and dst.resolve() in ((root / out).resolve(), Path(out).resolve()):
            return os.path.relpath(c)
    return None


def mark_stale(dst) -> str | None:
    """After a merge: mark ``dst/table.md`` stale (a first line naming the command that rewrites
    it) and return the message to print; None when the folder has no table."""
    table = Path(dst) / "table.md"
    if not table.is_file():
        return None
    cmd = report_command(dst)
    text = table.read_text()
    if not text.startswith(STALE):
        table.write_text(f"{STALE} `{cmd}`\n\n{text}")
    sets = []
    info = Path(dst) / "report.json"
    if info.is_file():
        sets = json.loads(info.read_text()).get("set") or []
    also = f" (the last run there also had: {' '.join('--set ' + s for s in sets)})" if sets else ""
    return f"{table} (and the figures) are stale now: regenerate them with\n  {cmd}{also}"


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvjax.evaluation.results_store",
                                 description="Merge one results folder's records into another (same evaluation). "
                                             "A table written from the destination before is stale afterwards: "
                                             "regenerate it with --report (the command is printed).")
    ap.add_argument("src", help="the folder whose records are added")
    ap.add_argument("dst", help="the folder that receives them (a new or empty folder takes src's fingerprint)")
    a = ap.parse_args()
    try:
        added = merge_into(a.dst, a.src)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"python -m kvjax.evaluation.results_store: {e}")
    print(f"added {added} records of {a.src} to {a.dst}")
    if added and (note := mark_stale(a.dst)):
        print(note)
    elif added and not (Path(a.dst) / "table.md").exists() and (Path(a.dst) / "report.json").is_file():
        print(f"write its table and figures with\n  {report_command(a.dst)}")
