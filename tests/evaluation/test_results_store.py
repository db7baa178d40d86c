"""The per-problem results store: a changed run is refused, a changed scorer drops only its
policy's records, a fingerprint written before the run / policies split still resumes, and a
folder in use by another evaluation is refused."""

import gzip
import json

import pytest

from kvjax.evaluation.results_store import ResultsStore, read_records, record_key

RUN = {"model": "m", "weights": "w1", "split": "test"}
POLICIES = {"kv": {"scorer": ["s", "d1"]}, "lk": {"scorer": ["l", "e1"], "student": ["t", "f1"]}}


def _filled(tmp_path):
    st = ResultsStore(tmp_path, RUN, policies=POLICIES)
    st.add([{"key": record_key(1, 0.75, p, i), "v": i} for p in ("dense", "kv", "lk") for i in range(3)])
    st.close()


def test_changed_scorer_drops_only_its_policy(tmp_path):
    _filled(tmp_path)
    st = ResultsStore(tmp_path, RUN, policies={**POLICIES, "kv": {"scorer": ["s", "d2"]}})
    assert st.discarded == {"kv": 3}
    assert sorted(k.split("|")[2] for k in st.records) == ["dense"] * 3 + ["lk"] * 3
    st.close()
    again = ResultsStore(tmp_path, RUN, policies={**POLICIES, "kv": {"scorer": ["s", "d2"]}})
    assert again.discarded == {} and len(again.records) == 6      # the file itself was rewritten


def test_a_torn_tail_and_a_key_written_twice_are_mended_on_load(tmp_path):
    """Two writers once appended the same batch (the lock file removed by hand): the later
    line of a key wins, once; a torn last line is dropped and recomputed."""
    _filled(tmp_path)
    path = tmp_path / "problems.jsonl.gz"
    twice = json.dumps({"key": record_key(1, 0.75, "kv", 1), "v": 10})
    member = gzip.compress((twice + "\n" + '{"key": "1|0.75|kv|').encode())
    path.write_bytes(path.read_bytes() + member + gzip.compress(b'{"key": "1|0.75|kv|2"}\n')[:-9])   # and a cut member
    st = ResultsStore(tmp_path, RUN, policies=POLICIES)
    assert len(st.records) == 9 and st.records[record_key(1, 0.75, "kv", 1)]["v"] == 10
    st.close()
    lines = [json.dumps(r) for r in read_records(tmp_path)]
    assert len(lines) == 9 and twice in lines


def test_the_store_is_gzip_one_member_after_close_and_a_legacy_jsonl_is_converted(tmp_path):
    _filled(tmp_path / "a")
    data = (tmp_path / "a" / "problems.jsonl.gz").read_bytes()
    text = gzip.decompress(data).decode()
    assert data[:2] == b"\x1f\x8b" and data.count(b"\x1f\x8b\x08") == 1 and len(text.splitlines()) == 9
    assert len(data) < len(text.encode())
    legacy = tmp_path / "b"
    legacy.mkdir()
    (legacy / "problems.jsonl").write_text(text)
    (legacy / "fingerprint.json").write_text((tmp_path / "a" / "fingerprint.json").read_text())
    st = ResultsStore(legacy, RUN, policies=POLICIES)
    assert len(st.records) == 9 and not (legacy / "problems.jsonl").exists()
    st.close()
    assert (legacy / "problems.jsonl.gz").read_bytes() == data     # the same bytes: no time or name in the header


def test_changed_run_is_refused_and_nothing_is_lost(tmp_path):
    _filled(tmp_path)
    with pytest.raises(ValueError, match="differs in: weights"):
        ResultsStore(tmp_path, {**RUN, "weights": "w2"}, policies=POLICIES)
    assert len(ResultsStore(tmp_path, RUN, policies=POLICIES).records) == 9


def test_legacy_flat_fingerprint_resumes(tmp_path):
    _filled(tmp_path)
    legacy = {**RUN, "scorers": {"kv": ["s", "d1"], "lk": ["l", "e1"]}, "students": {"lk": ["t", "f1"]}}
    (tmp_path / "fingerprint.json").write_text(json.dumps(legacy))
    st = ResultsStore(tmp_path, RUN, policies=POLICIES)
    assert st.discarded == {} and len(st.records) == 9
    assert json.loads((tmp_path / "fingerprint.json").read_text()) == {"run": RUN, "policies": POLICIES}


def test_run_over_a_subset_of_policies_keeps_the_others(tmp_path):
    _filled(tmp_path)
    st = ResultsStore(tmp_path, RUN, policies={"lk": POLICIES["lk"]})       # kv not in this run
    assert st.discarded == {} and len(st.records) == 9
    st.close()
    assert json.loads((tmp_path / "fingerprint.json").read_text())["policies"] == POLICIES
    st = ResultsStore(tmp_path, RUN, policies={"kv": {"scorer": ["s", "d2"]}})   # kv retrained
    assert st.discarded == {"kv": 3} and len(st.records) == 6


def test_folder_in_use_is_refused_and_released_on_close(tmp_path):
    first = ResultsStore(tmp_path, RUN, policies=POLICIES)
    with pytest.raises(RuntimeError, match="in use by another evaluation"):
        ResultsStore(tmp_path, RUN, policies=POLICIES)
    first.close()
    ResultsStore(tmp_path, RUN, policies=POLICIES).close()


def test_merge_adds_the_missing_records_once_and_refuses_another_evaluation(tmp_path):
    from kvjax.evaluation.results_store import merge_into

    a, b = tmp_path / "a", tmp_path / "b"
    _filled(a)
    st = ResultsStore(b, RUN, policies=POLICIES)
    st.add([{"key": record_key(2, 0.75, p, i), "v": 10 + i} for p in ("dense", "kv") for i in range(2)]
           + [{"key": record_key(1, 0.75, "dense", 0), "v": 99}])          # a key a already holds
    st.close()
    assert merge_into(a, b) == 4 and merge_into(a, b) == 0
    merged = ResultsStore(a, RUN, policies=POLICIES)
    assert len(merged.records) == 13 and merged.records[record_key(1, 0.75, "dense", 0)]["v"] == 0
    assert merged.records[record_key(2, 0.75, "kv", 1)]["v"] == 11
    merged.close()
    other = tmp_path / "c"
    ResultsStore(other, {**RUN, "split": "valid"}, policies=POLICIES).close()
    with pytest.raises(ValueError, match="differ in: split"):
        merge_into(a, other)
    rescored = tmp_path / "d"
    ResultsStore(rescored, RUN, policies={**POLICIES, "kv": {"scorer": ["s", "d2"]}}).close()
    with pytest.raises(ValueError, match="kv with different files"):
        merge_into(a, rescored)
    with pytest.raises(FileNotFoundError, match="no fingerprint.json"):
        merge_into(a, tmp_path / "missing")
    held = ResultsStore(b, RUN, policies=POLICIES)
    with pytest.raises(RuntimeError, match="in use"):
        merge_into(a, b)
    held.close()
    assert len(ResultsStore(a, RUN, policies=POLICIES).records) == 13        # nothing half-written


def test_a_closed_store_leaves_no_lock_file(tmp_path):
    _filled(tmp_path)
    assert not (tmp_path / ".lock").exists()
    st = ResultsStore(tmp_path, RUN, policies=POLICIES)
    assert (tmp_path / ".lock").read_text() == str(__import__("os").getpid())
    st.close()
    assert not (tmp_path / ".lock").exists()


def test_merging_a_folder_into_itself_is_refused_and_leaves_no_lock(tmp_path):
    from kvjax.evaluation.results_store import merge_into

    _filled(tmp_path / "a")
    for dst in (tmp_path / "a", tmp_path / "a" / ".." / "a"):
        with pytest.raises(ValueError, match="are the same folder: nothing to merge"):
            merge_into(dst, tmp_path / "a")
    assert not (tmp_path / "a" / ".lock").exists()
    assert len(ResultsStore(tmp_path / "a", RUN, policies=POLICIES).records) == 9      # free, intact


@pytest.mark.parametrize("made", [False, True])
def test_merge_into_a_new_or_empty_folder_takes_the_sources_fingerprint(tmp_path, made):
    from kvjax.evaluation.results_store import merge_into

    _filled(tmp_path / "a")
    dst = tmp_path / "new"
    if made:
        dst.mkdir()
    assert merge_into(dst, tmp_path / "a") == 9
    assert json.loads((dst / "fingerprint.json").read_text()) == {"run": RUN, "policies": POLICIES}
    assert len(ResultsStore(dst, RUN, policies=POLICIES).records) == 9
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="no fingerprint.json"):      # not empty, not a results folder
        merge_into(junk, tmp_path / "a")


def test_the_merge_cli_marks_the_table_stale_and_prints_the_report_command(tmp_path):
    import os
    import shlex
    import subprocess
    import sys

    from kvjax.evaluation.results_store import STALE

    a, b = tmp_path / "a", tmp_path / "b"
    _filled(a)
    st = ResultsStore(b, RUN, policies=POLICIES)
    st.add([{"key": record_key(2, 0.75, "dense", 0), "v": 1}])
    st.close()
    (a / "table.md").write_text("| policy | 1k, 75% |\n")
    (a / "report.json").write_text(json.dumps({"config": "configs/longctx-x.yaml", "set": ["lengths=[1024]"]}))

    def merge(*args):
        return subprocess.run([sys.executable, "-m", "kvjax.evaluation.results_store", *map(str, args)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})

    res = merge(b, a)
    assert res.returncode == 0, res.stderr
    want = ["python", "-m", "kvjax.longctx", "--config", "configs/longctx-x.yaml", "--set", f"out_dir={a}", "--report"]
    lines = res.stdout.strip().splitlines()
    assert lines[0] == f"added 1 records of {b} to {a}" and "table.md (and the figures) are stale" in lines[1]
    assert shlex.split(lines[2].split(" (the last run")[0]) == want and "--set lengths=[1024]" in lines[2]
    table = (a / "table.md").read_text()
    assert table.startswith(STALE) and shlex.split(table.splitlines()[0].split("`")[1]) == want
    assert table.endswith("| policy | 1k, 75% |\n")
    same = merge(a, a)
    assert same.returncode == 1 and same.stderr.strip().splitlines() == [
        f"python -m kvjax.evaluation.results_store: {a} and {a} are the same folder: nothing to merge (name the folder "
        "whose records are added first, then the folder that receives them)"]
    assert not (a / ".lock").exists()
