"""Retention on traces (the seed's Figures 6 and 7): records equal a direct computation, the
oracle recalls itself, the run resumes, figures are written, bad settings are named."""

import json

import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.evaluation.oracle import oracle_priorities
from kvjax.evaluation.retention import kept_positions, positions_to_mask
from kvjax.evaluation.trace_retention import (RetentionConfig, budget, markdown, run_retention, token_labels,
                                              write_figures)
from kvjax.eviction.policies import make_policy


@pytest.fixture(scope="module")
def model():
    cfg = kvjax.ModelConfig("llama", 97, 32, 64, 2, 4, 2, 16, max_position_embeddings=512)
    return kvjax.Decoder(cfg, rngs=nnx.Rngs(0), init_std=0.3, embed_init_std=1.0)


class _Tok:                       # the two tokenizer calls the figure needs
    def convert_ids_to_tokens(self, ids):
        return [f"Ġw{i}" for i in ids]


def _traces(tmp_path, lengths):
    rs = np.random.RandomState(2)
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"id": f"t{i}", "tokens": rs.randint(0, 97, n).tolist()}) + "\n"
                         for i, n in enumerate(lengths)))
    return f


def test_records_equal_a_direct_computation_resume_and_figures(model, tmp_path):
    f = _traces(tmp_path, [64, 40, 80, 70])               # the 40-token trace is skipped
    cfg = RetentionConfig(traces=[str(f)], out_dir=str(tmp_path / "out"), policies=["streaming_llm", "knorm"],
                          crop=64, compression=0.5, sinks=2, window=4, batch_size=2, map_trace=1, map_last=20,
                          map_policies=["oracle", "knorm"])
    summary, records = run_retention(cfg, model=model, progress=False)
    assert {p: s["n"] for p, s in summary.items()} == {"streaming_llm": 3, "knorm": 3, "oracle": 3}
    assert summary["oracle"]["recall"] == 1.0            # the oracle keeps its own long-range set
    # trace t2 (index 1 of the selected): knorm's recall per head, computed directly
    tokens = np.asarray([json.loads(f.read_text().splitlines()[2])["tokens"][:64]], np.int32)
    ev = budget(cfg)
    _, olr = kept_positions(model, tokens, [64], make_policy("oracle", ev,
                                                             params=oracle_priorities(model, tokens, 4, "mean")))
    every, _ = kept_positions(model, tokens, [64], make_policy("knorm", ev))
    o, k = positions_to_mask(olr, 64)[:, 0], positions_to_mask(every, 64)[:, 0]
    want = (o & k).sum(-1) / o.sum(-1)
    rec = next(r for r in records if r["id"] == "t2" and r["policy"] == "knorm")
    np.testing.assert_allclose(rec["recall"], want, atol=1e-4)
    # the same kept set per layer and head (slot order may differ between batch shapes)
    np.testing.assert_array_equal(np.sort(rec["kept"], -1), np.sort(every[:, 0], -1))
    assert "kept" not in next(r for r in records if r["id"] == "t0")
    assert 0.0 < summary["knorm"]["recall"] < 1.0
    before = (tmp_path / "out" / "problems.jsonl.gz").read_bytes()
    again, _ = run_retention(cfg, model=model, progress=False)     # all stored: nothing recomputed
    assert again == summary and (tmp_path / "out" / "problems.jsonl.gz").read_bytes() == before
    paths = write_figures(cfg, summary, records, _Tok())
    assert [p.name for p in paths] == ["figure7_recall.png", "figure6_eviction_map.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    assert "| knorm (N=3) |" in markdown(summary)


def test_bad_settings_are_named(model, tmp_path):
    f = _traces(tmp_path, [40])
    with pytest.raises(ValueError, match="no trace in .* reaches crop=64"):
        run_retention(RetentionConfig(traces=[str(f)], out_dir=str(tmp_path / "o"), crop=64, compression=0.5,
                                      sinks=2, window=4), model=model, progress=False)
    with pytest.raises(ValueError, match="leaves no long-range slot"):
        RetentionConfig(crop=64, compression=0.9, sinks=2, window=4)
    assert token_labels(_Tok(), [5]) == ["·w5"]
