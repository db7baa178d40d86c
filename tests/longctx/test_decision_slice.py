"""The decision slice read from the committed stores: its scores are the full table's records on
the slice's problems, and its rank agreement is Spearman's rho over those scores."""

import json
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


def _records(folder):
    return read_records(os.path.join(ROOT, folder))


@pytest.fixture(scope="module")
def res():
    return compare(load_config(LongCtxConfig, FULL), load_config(LongCtxConfig, SLICE))


def test_slice_scores_are_the_full_stores_records_on_the_slice_problems(res):
    full = _records("results/longctx/smollm2-compressed")
    rows = {r["policy"]: r for r in res["rows"]}
    tasks = ("niah_noise", "niah_text", "niah_multikey")
    for policy in ("snapkv", "lkv", "streaming_llm"):
        per_task = [np.mean([r["score"] for r in full if r["policy"] == policy and r["length"] == 1024
                             and r["task"] == t and r["index"] < 32 and r["compression"] == 0.75]) for t in tasks]
        assert rows[policy]["slice@0.75"][0] == pytest.approx(np.mean(per_task))
    own = _records("results/longctx/smollm2-baselines-1k")
    kz = np.mean([r["score"] for r in own if r["policy"] == "kvzip" and r["compression"] == 0.88])
    assert rows["kvzip"]["slice@0.88"][0] == pytest.approx(kz) and rows["kvzip"]["full@0.88"] is None


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
