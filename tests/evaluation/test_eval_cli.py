"""eval.py end to end on tiny models: the quality table (rows, Rel columns, recall, plots,
learned scorers, length generalisation, resuming) and the decode benchmark."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
from flax import nnx

import kvjax
from kvjax.evaluation.results_store import read_records
from kvjax.data import save_tokenizer
from kvjax.eviction.learned import from_scorer
from kvjax.export import export_scorers
from kvjax.scorers import MLPScorer
from train_helpers import TINY_MODEL
from paths import ROOT, TESTS  # noqa: F401



def _tiny_teacher(path):
    model = kvjax.Decoder(kvjax.ModelConfig.from_hf_config(TINY_MODEL), rngs=nnx.Rngs(0), init_std=0.3,
                          embed_init_std=1.0)
    kvjax.save_hf(model, path)
    save_tokenizer(path)
    return model


def _eval(*sets, timeout=900):
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def test_quality_mode_table_plots_lengths_and_learned_scorers(tmp_path):
    """Rows for every (length, compression, policy), the Rel columns, oracle recall exactly 1,
    an exported (here untrained) KVpop scorer evaluated by label, and both plots."""
    model = _tiny_teacher(tmp_path / "m")
    cfg = model.config
    export_scorers(from_scorer(MLPScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, rngs=nnx.Rngs(1)),
                               kvjax.EvictionConfig(4, 2, 10)), tmp_path / "kv")
    res = _eval(f"model={tmp_path / 'm'}", f"out_dir={tmp_path / 'out'}", "num_problems=2", "batch_size=2",
                "testbed={length: 128, num_names: 16}", "length_factors=[1,2]",
                f"scorers={{mine: {tmp_path / 'kv'}}}", "policies=[dense,h2o,oracle,oracle_peak,mine]")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {(r["length"], r["policy"]): r for r in out["rows"]}
    assert len(rows) == 2 * 5 and all(r["problems"] == 2 and r["compression"] == 0.75 for r in rows.values())
    assert rows[(128, "h2o")]["budget"] == 32 and rows[(256, "mine")]["budget"] == 64
    for length in (128, 256):
        dense = rows[(length, "dense")]
        assert dense["budget"] == "dense" and abs(dense["kl"]) < 1e-6
        assert rows[(length, "oracle")]["recall"] == 1.0
        for p in ("h2o", "mine", "oracle", "oracle_peak"):
            r = rows[(length, p)]
            assert 0.0 <= r["recall"] <= 1.0 and r["kl"] >= -1e-6
            rel = r["graded"] / dense["graded"] if dense["graded"] else float("nan")
            assert r["graded_rel"] == rel or (rel != rel and r["graded_rel"] != r["graded_rel"])
            assert len(r["recall_per_head"]) == cfg.num_layers and len(r["recall_per_head"][0]) == cfg.num_kv_heads
    # the learned policy's sparse logits equal its decode path's, checked on the first length only
    assert rows[(128, "mine")]["decode_diff"] < 1e-3 and rows[(128, "mine")]["decode_agree"] == 1.0
    assert "decode_diff" not in rows[(256, "mine")] and "decode_diff" not in rows[(128, "h2o")]
    lines = [json.dumps(r) for r in read_records(tmp_path / "out")]
    assert len(lines) == 2 * 5 * 2                             # lengths x policies x problems
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| 128 | 0.750 | h2o | 32 |" in md and "| 256 | 0.750 | mine | 64 |" in md
    assert (tmp_path / "out" / "recall_heads.png").stat().st_size > 0
    assert (tmp_path / "out" / "eviction_map.png").stat().st_size > 0


def test_quality_mode_resumes_without_recomputing_or_mixing(tmp_path):
    """An interrupted run (records for some problems, a torn last line) resumes: only the
    missing problems are computed and the table equals an uninterrupted run's; another
    evaluation in the same folder is refused, naming what differs."""
    _tiny_teacher(tmp_path / "m")
    common = [f"model={tmp_path / 'm'}", "num_problems=4", "batch_size=2", "testbed={length: 128, num_names: 16}",
              "policies=[dense,streaming_llm]"]
    full = _eval(*common, f"out_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr[-3000:]
    part = _eval(*common, f"out_dir={tmp_path / 'part'}")
    assert part.returncode == 0, part.stderr[-3000:]
    path = tmp_path / "part" / "problems.jsonl.gz"
    lines = [json.dumps(r) for r in read_records(tmp_path / "part")]
    assert len(lines) == 8
    torn = "\n".join(lines[:5]) + "\n" + lines[5][: len(lines[5]) // 2]          # crash mid-write
    path.write_bytes(gzip.compress(torn.encode()))
    # a scorer this run does not evaluate is neither loaded nor fingerprinted (its folder may not exist)
    again = _eval(*common, f"out_dir={tmp_path / 'part'}", f"scorers={{unused: {tmp_path / 'nowhere'}}}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming: 5 of 8" in again.stdout + again.stderr
    assert len(read_records(tmp_path / "part")) == 8
    a = json.loads((tmp_path / "full" / "results.json").read_text())["rows"]
    b = json.loads((tmp_path / "part" / "results.json").read_text())["rows"]
    assert json.dumps(a) == json.dumps(b)   # (text: NaN entries compare equal)
    other = _eval(*common[:-2], "testbed={length: 160, num_names: 16}", common[-1], f"out_dir={tmp_path / 'part'}")
    assert other.returncode != 0 and "differs in: testbed" in other.stderr
    # a fixed window is another budget: refused too, not mixed with the default window's records
    fixed = _eval(*common, "window=2", f"out_dir={tmp_path / 'part'}")
    assert fixed.returncode != 0 and "differs in: window" in fixed.stderr
    # ... and in its own folder it reaches every budget: same total, the window as given
    own = _eval(*common[:1], "num_problems=2", *common[2:], "window=5", f"out_dir={tmp_path / 'w5'}")
    assert own.returncode == 0, own.stderr[-3000:]
    rows = {r["policy"]: r for r in json.loads((tmp_path / "w5" / "results.json").read_text())["rows"]}
    default = {r["policy"]: r for r in a}
    assert rows["streaming_llm"]["window"] == 5 and default["streaming_llm"]["window"] == 2   # 32 / 16
    assert rows["streaming_llm"]["budget"] == default["streaming_llm"]["budget"] == 32
    assert "| streaming_llm | 32 | 5 |" in (tmp_path / "w5" / "results.md").read_text()


def test_budget_for_window():
    """The default window is 1/16 of the budget; a fixed window replaces it and the budget total
    is unchanged; a window that leaves no top-k slot is refused."""
    import pytest

    from kvjax.evaluation.budgets import budget_for, fixed_window_budget

    d = budget_for(512, 0.94)
    assert (d.sinks, d.window, d.topk) == (4, 2, 25)
    f = budget_for(512, 0.94, window=4)
    assert (f.sinks, f.window, f.topk) == (4, 4, 23) and f.budget == d.budget == 31
    with pytest.raises(ValueError, match="leaves no top-k slot after 4 sinks \\+ 27 window"):
        budget_for(512, 0.94, window=27)
    # the real-model evaluations' fixed budgets: sinks + window may fill the budget, not exceed it
    assert fixed_window_budget(1024, 0.94, sinks=4, window=32).topk == 25
    with pytest.raises(ValueError, match="4 sinks \\+ 32 window exceed the budget of 31 slots"):
        fixed_window_budget(512, 0.94, sinks=4, window=32)


def test_bench_mode_small(tmp_path):
    """eval.py bench at two short lengths: every implementation measured, the bounded cache's
    bytes fixed while the dense cache grows, the table and plot written."""
    res = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--set", "mode=bench",
                          "--set", f"out_dir={tmp_path}", "--set", "bench_lengths=[256,1024]",
                          "--set", "bench_batches=[1]", "--set", "bench_budget=128", "--set", "bench_steps=4",
                          "--set", "bench_repeats=1"], capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["impl"], r["length"]): r for r in out["rows"]}
    assert all("latency_s" in r for r in rows.values()), out["rows"]
    assert rows[("kvjax-kvpop", 256)]["cache_bytes"] == rows[("kvjax-kvpop", 1024)]["cache_bytes"]
    assert rows[("kvjax-dense", 1024)]["cache_bytes"] > 3 * rows[("kvjax-dense", 256)]["cache_bytes"]
    assert rows[("transformers-dense", 1024)]["peak_rss_bytes"] > 0 and (tmp_path / "decode_bench.png").exists()
    assert "| kvjax-kvpop | 1 | 1024 |" in (tmp_path / "results.md").read_text()
    sp = {r["length"]: r for r in out["speedups"]}
    ideal = rows[("kvjax-dense", 1024)]["bytes_per_step"] / rows[("kvjax-kvpop", 1024)]["bytes_per_step"]
    assert abs(sp[1024]["kvpop_vs_dense_ideal"] - ideal) < 1e-9 and ideal > sp[256]["kvpop_vs_dense_ideal"]
    assert sp[1024]["dense_vs_transformers"] == (rows[("transformers-dense", 1024)]["latency_s"]
                                                 / rows[("kvjax-dense", 1024)]["latency_s"])
    assert "| 1 | 1024 |" in (tmp_path / "results.md").read_text().split("ideal")[1]


def test_eval_config_errors_name_the_problem():
    import pytest

    from kvjax.evaluation.config import EvalConfig

    for kw, msg in [(dict(policies=["dense", "nope"]), "unknown policy 'nope'"),
                    (dict(policies=["kvpop_mlstm"]), "'kvpop_mlstm' is a learned policy"),
                    (dict(scorers={"h2o": "x"}), "'h2o' is a heuristic policy's name"),
                    (dict(scorers={"a": "x"}, students={"b": "y"}), "students: label 'b' has no entry"),
                    (dict(length_factors=[0]), "length_factors must be positive"),
                    (dict(compressions=[1.0]), "compressions: each must be in"),
                    (dict(window=0), "window must be >= 1"),
                    (dict(window=16, compressions=[0.75, 0.97], testbed={"length": 512}),
                     "window: a budget of 15 slots \\(97% of 512 tokens\\) leaves no top-k slot")]:
        with pytest.raises(ValueError, match=msg):
            EvalConfig(**kw)
    assert EvalConfig(scorers={"kvpop_mlstm": "x"}, policies=["dense", "kvpop_mlstm"]).policies[1] == "kvpop_mlstm"


def test_path_check_measures_only_real_tokens():
    from kvjax.evaluation.quality import _path_check

    a = np.zeros((2, 5, 3), np.float32)
    a[:, :, 0] = 1.0
    b = a.copy()
    b[0, 2, 1] = 3.0      # row 0: one position disagrees (argmax flips), diff 3
    b[1, 4, 2] = 9.0      # row 1: beyond its length 4, ignored
    assert _path_check(a, b, np.array([5, 4])) == [[3.0, 0.8], [0.0, 1.0]]
