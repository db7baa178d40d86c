"""The per-problem results store: a changed run is refused, a changed scorer drops only its
policy's records, a fingerprint written before the run / policies split still resumes, and a
folder in use by another evaluation is refused."""

import json

import pytest

from kvjax.evaluation.results_store import ResultsStore, record_key

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
