"""``experiments/eval_throughput.py``: kvjax's and kvpress's per-record seconds side by side, kvjax's
compiling first batch apart, kvpress's press names matched to kvjax's policies."""

import importlib.util
import os

import pytest
from paths import ROOT


def _mod():
    spec = importlib.util.spec_from_file_location("eval_throughput", os.path.join(ROOT, "experiments",
                                                                                   "eval_throughput.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_means_medians_ratios_and_totals():
    m = _mod()
    ours = [{"id": f"1024/niah_noise/{i}", "policy": p, "seconds": s}
            for i, (p, s) in enumerate([("dense", 9.0), ("dense", 1.0), ("dense", 1.0),
                                        ("adakv", 5.0), ("adakv", 0.5), ("adakv", 0.5),
                                        ("kvzip", 4.0), ("kvzip", 0.5), ("kvzip", 0.5)])]
    theirs = [{"press": p, "seconds": s} for p, s in [("none", 3.0), ("none", 3.0), ("adakv_snapkv", 2.0),
                                                      ("kvzip", 5.0)]]
    first = {"1024/niah_noise/0", "1024/niah_noise/3"}           # the compiling batch
    j = m.per_method(ours, lambda r: r["policy"], first)
    assert j["dense"] == {"n": 3, "median_s": 1.0, "sum_s": 11.0, "median_after_first_s": 1.0,
                          "mean_after_first_s": 1.0}
    assert j["adakv"]["median_after_first_s"] == 0.5
    assert j["kvzip"]["median_after_first_s"] == 0.5 and j["kvzip"]["mean_after_first_s"] == pytest.approx(5 / 3)
    summary = {"methods": ["dense", "adakv", "kvzip", "tova"],
               "kvjax": {"methods": j, "records": 9, "wall_s": 30.0, "sum_s": 22.0, "load_before": 0.1, "load_after": 1.0},
               "kvpress": {"methods": m.per_method(theirs, lambda r: r["press"]), "records": 4, "wall_s": 40.0,
                           "sum_s": 13.0, "load_before": 0.1, "load_after": 1.0}}
    md = m.markdown(summary)
    assert "| dense | 3 | 3.67 | 1.00 (1.00) | 3.00 (3.00) | 3.0x |" in md
    assert "| adakv | 3 | 2.00 | 0.50 (0.50) | 2.00 (2.00) | 4.0x |" in md
    assert "| kvzip | 3 | 1.67 | 1.67 (0.50) | 5.00 (5.00) | 3.0x |" in md     # bimodal: the mean counts
    assert "| tova | | missing | | missing | |" in md
    assert "wall-clock per record: 3.0x" in md                 # 10 s vs 3.33 s a record
    assert f"sum of record seconds per record: {(13 / 4) / (22 / 9):.1f}x" in md


def test_an_existing_run_folder_is_refused(tmp_path):
    (tmp_path / "kvjax").mkdir()
    with pytest.raises(SystemExit, match="already holds a run"):
        _mod().main(["--out", str(tmp_path), "--kvpress-python", "/bin/sh"])
