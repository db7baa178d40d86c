"""The decision slice read from the committed stores: a policy's slice score and time are the
slice's own records where its store holds that policy, else the full table's records on the
slice's problems; its rank agreement is Spearman's rho over those scores."""

import dataclasses
import os

import numpy as np
import pytest
from scipy.stats import spearmanr

from kvjax.configio import load_config
from kvjax.evaluation.results_store import read_records
from kvjax.longctx.decision_slice import compare, main
from kvjax.longctx.run import LongCtxConfig
from paths import ROOT

FULL = os.path.join(ROOT, "configs/longctx-smollm2-compressed.yaml")
SLICE = os.path.join(ROOT, "configs/longctx-smollm2-baselines-1k.yaml")


TASKS = ("niah_noise", "niah_text", "niah_multikey")


def _records(folder):
    return read_records(os.path.join(ROOT, folder))


def _task_average(records, policy, comp, slice_only=False):
    keep = [r for r in records if r["policy"] == policy and r["length"] == 1024 and r["compression"] == comp
            and (not slice_only or r["index"] < 32)]
    return np.mean([np.mean([r["score"] for r in keep if r["task"] == t]) for t in TASKS])


@pytest.fixture(scope="module")
def res():
    return compare(load_config(LongCtxConfig, FULL), load_config(LongCtxConfig, SLICE))


def test_the_slices_own_records_win_over_the_full_store(res):
    """Every row the slice config runs (dense too, which both stores hold) is scored and timed
    from the slice's own store."""
    slc = load_config(LongCtxConfig, SLICE)
    own = _records(slc.out_dir)
    rows = {r["policy"]: r for r in res["rows"]}
    for policy in dict.fromkeys(["dense", *slc.policies, *slc.learned]):
        for comp in slc.compressions:                 # dense's one record stands in every column
            stored = _task_average(own, policy, 0.0 if policy == "dense" else comp)
            assert rows[policy][f"slice@{comp:g}"][0] == pytest.approx(stored)
        cols = [0.0] if policy == "dense" else slc.compressions    # the store may hold other columns (94%)
        assert rows[policy]["seconds"] == pytest.approx(sum(r["seconds"] for r in own if r["policy"] == policy
                                                            and r["compression"] in cols))
    full_dense = sum(r["seconds"] for r in _records("results/longctx/smollm2-compressed") if r["policy"] == "dense"
                     and r["length"] == 1024 and r["index"] < 32 and r["task"] in TASKS)
    assert rows["dense"]["seconds"] != pytest.approx(full_dense)      # the two stores differ: the test can fail
    assert rows["kvzip"]["full@0.88"] is None and rows["dense"]["full@0.88"] is not None


def test_a_narrow_slice_reads_the_other_rows_from_the_full_store():
    """A slice config that runs only dense and the baselines still gets every full-table row,
    scored and timed from the full store's records on the slice's first 32 problems per task."""
    slc = load_config(LongCtxConfig, SLICE)
    narrow = dataclasses.replace(slc, policies=["dense", "keydiff", "kvzip"], learned={}, learned_budgets={})
    rows = {r["policy"]: r for r in compare(load_config(LongCtxConfig, FULL), narrow)["rows"]}
    full = _records("results/longctx/smollm2-compressed")
    for policy in ("snapkv", "lkv", "streaming_llm"):
        assert rows[policy]["slice@0.75"][0] == pytest.approx(_task_average(full, policy, 0.75, slice_only=True))
        assert rows[policy]["seconds"] == pytest.approx(
            sum(r["seconds"] for r in full if r["policy"] == policy and r["length"] == 1024 and r["index"] < 32
                and r["task"] in TASKS))
    own = _records("results/longctx/smollm2-baselines-1k")
    assert rows["kvzip"]["slice@0.88"][0] == pytest.approx(_task_average(own, "kvzip", 0.88))
    assert rows["kvzip"]["full@0.88"] is None


def test_rank_agreement_is_spearman_over_the_shared_policies(res):
    rows = [r for r in res["rows"] if r["full@0.75"] is not None and r["policy"] != "dense"]
    a = [r["slice@0.75"][0] for r in rows]
    b = [r["full@0.75"] for r in rows]
    assert res["agreement"][0.75]["policies"] == len(rows) >= 10
    assert res["agreement"][0.75]["spearman"] == pytest.approx(spearmanr(a, b).statistic)


def test_a_slice_outside_the_full_table_is_refused(tmp_path, capsys):
    bad = tmp_path / "s.yaml"
    bad.write_text(open(SLICE).read().replace("lengths: [1024]", "lengths: [512]"))
    assert main(["--full", FULL, "--slice", str(bad)]) == 2
    assert "the slice's 512 is not in the full table" in capsys.readouterr().err
