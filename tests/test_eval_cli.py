"""eval.py quality mode end to end on a tiny random model: the table's rows, files and
the relative-answer column."""

import json
import os
import subprocess
import sys

from flax import nnx

import kvjax
from kvjax.data import save_tokenizer
from train_helpers import TINY_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quality_mode_writes_the_table(tmp_path):
    model = kvjax.Decoder(kvjax.ModelConfig.from_hf_config(TINY_MODEL), rngs=nnx.Rngs(0), init_std=0.3,
                          embed_init_std=1.0)
    kvjax.save_hf(model, tmp_path / "m")
    save_tokenizer(tmp_path / "m")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--set", f"model={tmp_path / 'm'}",
                          "--set", f"out_dir={tmp_path / 'out'}", "--set", "num_problems=4", "--set", "batch_size=4",
                          "--set", "testbed={length: 128, num_names: 16}",
                          "--set", "policies=[dense,streaming_llm,oracle]"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["dense", "streaming_llm", "oracle"]
    dense = rows[0]
    assert dense["budget"] == "dense" and abs(dense["kl"]) < 1e-6 and rows[1]["budget"] == 32
    assert all(0.0 <= r["lookup_far"] <= 1.0 and r["kl"] >= -1e-6 for r in rows)
    assert "| 0.750 | streaming_llm | 32 |" in (tmp_path / "out" / "results.md").read_text()


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
