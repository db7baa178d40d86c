"""Long generation (the seed's Figure 4): the timed kvjax run generates exactly what ``generate``
does, transformers' run matches it token for token, and the sweep stores, resumes and reports."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import kvjax
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.policies import make_policy
from kvjax.evaluation import long_generation as lg
from kvjax.evaluation.jsonl_gz import read_jsonl

PROMPT = [1, 5, 9, 14, 3, 7, 22, 40, 11]


@pytest.mark.parametrize("bounded", [False, True])
def test_timed_generation_is_generate(tiny_llama, bounded):
    """Segments of the decode engine give ``kvjax.generate``'s greedy tokens, for the dense cache
    and for a bounded one whose budget (16) the 48 generated tokens overflow."""
    policy = make_policy("streaming_llm", EvictionConfig(4, 4, 8)) if bounded else kvjax.cache.DenseKV()
    r = lg.time_generation(tiny_llama, policy, PROMPT, 2, 48, segment=20)     # segments of 8, 20, 20
    ref = np.asarray(kvjax.generate(tiny_llama, [PROMPT] * 2, 48, policy=policy if bounded else None,
                                    eos_token_id=[]))[:, len(PROMPT):]
    np.testing.assert_array_equal(r["tokens"], ref)
    assert r["steps"] == [0, 8, 28, 48] and len(r["times_s"]) == 4
    assert all(a < b for a, b in zip(r["times_s"], r["times_s"][1:]))
    dense_bytes = 2 * 2 * 2 * 2 * (len(PROMPT) + 48) * 16 * 4        # k+v, layers, batch, KV heads, slots, D, f32
    assert (r["cache_bytes"] < dense_bytes) if bounded else (r["cache_bytes"] == dense_bytes)


def test_bad_settings_are_named(tiny_llama):
    with pytest.raises(ValueError, match="must be positive"):
        lg.time_generation(tiny_llama, kvjax.cache.DenseKV(), PROMPT, 1, 40, segment=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        lg.time_generation(tiny_llama, kvjax.cache.DenseKV(), PROMPT, 1, 512, segment=16)
    with pytest.raises(ValueError, match="keeps 25 entries per head"):
        lg.budget(36, 64, 0.75)
    assert lg.budget(40, 2008, 0.75) == 512


def _hf_script():
    spec = importlib.util.spec_from_file_location("hf_long_generation", lg.HF_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_transformers_run_matches_kvjax(hf_dir):
    """The transformers side of the benchmark generates kvjax's tokens from the same weights, and
    its timestamps and cache size are those of a dense run of that length."""
    folder, _ = hf_dir("llama-gqa")
    spec = {"impl": "transformers-dense", "batch": 2, "length": 32, "compression": None, "model": str(folder),
            "prompt_ids": PROMPT, "segment": 8, "interval": 4}
    rec = _hf_script().run(spec)
    ours = lg.time_generation(kvjax.load_hf(folder), kvjax.cache.DenseKV(), PROMPT, 2, 32, segment=8)
    assert rec["head_tokens"] == ours["tokens"][0].tolist()
    assert rec["steps"] == [0, 8, 16, 24, 32] and len(rec["times_s"]) == 5
    # the largest cache transformers held: every prompt token and all but the last generated one
    assert rec["kv_bytes"] == 2 * 2 * 2 * 2 * (len(PROMPT) + 31) * 8 * 4
    x = lg.rates({**rec, "batch": 2})
    assert x["tokens_per_s"] == pytest.approx(64 / rec["times_s"][-1])


def test_sweep_stores_resumes_and_reports(hf_dir, tmp_path, monkeypatch):
    """Two kvjax runs and transformers' in their own processes, stored as they end; a second
    invocation runs nothing; the table, ratios and Figure 4 are written."""
    folder, _ = hf_dir("llama-gqa")
    monkeypatch.setattr(lg, "prompt_ids", lambda model: PROMPT)
    argv = ["--model", str(folder), "--lengths", "128", "--batches", "1", "--segment", "64", "--compressions", "0.5",
            "--impls", "kvjax-dense", "kvjax-streaming_llm", "transformers-dense", "--out", str(tmp_path)]
    assert lg.main(argv) == 0
    recs = read_jsonl(tmp_path / "records.jsonl.gz")
    assert sorted((r["impl"], r["compression"]) for r in recs) == [
        ("kvjax-dense", None), ("kvjax-streaming_llm", 0.5), ("transformers-dense", None)], recs
    assert all("error" not in r and r["peak_rss_bytes"] > 0 for r in recs)
    by = {r["impl"]: r for r in recs}
    assert by["kvjax-dense"]["head_tokens"] == by["transformers-dense"]["head_tokens"]
    assert by["kvjax-streaming_llm"]["keep"] == 68
    summary = json.loads((tmp_path / "summary.json").read_text())
    share = summary["ratios"][0]["streaming_llm_50_kv_share_of_dense"]   # 68 slots' keys and values, plus
    assert 68 / (len(PROMPT) + 128) <= share < 1.2 * 68 / (len(PROMPT) + 128)  # their positions and scores
    assert "| kvjax-streaming_llm 50% | 1 | 128 |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "long_generation.png").stat().st_size > 0
    with pytest.raises(ValueError, match="keeps 27 entries per head"):     # refused before running
        lg.main(argv[:-2] + ["--compressions", "0.8", "--out", str(tmp_path / "other")])
    stamp = (tmp_path / "records.jsonl.gz").read_bytes()
    assert lg.main(argv) == 0 and (tmp_path / "records.jsonl.gz").read_bytes() == stamp


def test_a_kvpress_run_without_kvpress_venv_is_refused_by_name(tmp_path):
    """Only kvpress's rows need its venv; asking for one without it names the venv and the rows."""
    argv = ["--lengths", "128", "--impls", "kvjax-dense", "kvpress-streaming_llm", "--hf-python",
            str(tmp_path / "missing" / "python"), "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match=r"missing/python: not found.*\['kvpress-streaming_llm'\]"):
        lg.main(argv)
    assert not (tmp_path / "records.jsonl.gz").exists()


def test_max_length_fills_the_models_positions_and_longer_is_refused():
    assert lg.resolve_lengths(["2048", "max"], 48, 8192) == [2048, 8144]
    with pytest.raises(SystemExit, match="prompt 48 \\+ 8192 generated tokens exceeds the model's "
                                         "max_position_embeddings=8192; use 'max' \\(8144\\)"):
        lg.resolve_lengths(["8192"], 48, 8192)
