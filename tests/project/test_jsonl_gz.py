"""``kvjax/evaluation/jsonl_gz.py``, the result stores' format, loaded by path as kvpress's venv loads it: appended members read
back in order, a torn tail dropped, compaction to one member with the same bytes every time."""

import gzip
import importlib.util
import json
import os

from paths import ROOT

spec = importlib.util.spec_from_file_location("jsonl_gz", os.path.join(ROOT, "kvjax", "evaluation", "jsonl_gz.py"))
store = importlib.util.module_from_spec(spec)
spec.loader.exec_module(store)


def test_appended_members_read_back_and_a_torn_tail_is_dropped(tmp_path):
    path = tmp_path / "records.jsonl.gz"
    recs = [{"id": i, "v": "x" * i} for i in range(5)]
    with path.open("ab") as f:
        for r in recs:
            f.write(store.gzip_member(json.dumps(r) + "\n"))
    assert store.read_jsonl(path) == recs
    said = []
    with path.open("ab") as f:
        member = store.gzip_member(json.dumps({"id": 9, "v": "y" * 40}) + "\n")
        f.write(member[: len(member) // 2])                                   # a crash mid-append
    assert store.stored_lines(path, said.append) == [json.dumps(r) for r in recs] and said
    store.compact(path, map(json.dumps, recs))
    data = path.read_bytes()
    assert data.count(b"\x1f\x8b\x08") == 1 and gzip.decompress(data).decode().count("\n") == 5
    store.compact(path, map(json.dumps, store.read_jsonl(path)))
    assert path.read_bytes() == data
    plain = tmp_path / "records.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"id": 7')
    assert store.read_jsonl(plain) == recs
