"""DMS: the soft eviction is the dense model when nothing is evicted and sinks + window when
everything is, training moves the eviction rate toward its target and resumes exactly, the
export loads back as the policy, and the trace batches are seeded and masked."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.dms.train import (DMSConfig, export_decisions, init_decisions, soft_eviction_backend, trace_batches,
                             train_decisions)
from kvjax.eviction.dms import dms_logits
from kvjax.models.attention import dense_attention


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


def test_no_eviction_is_dense_and_full_eviction_is_sinks_plus_window(tiny):
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 97, (2, 60)))
    dense, _ = tiny(tokens)
    keep = init_decisions(tiny.config, -60.0)
    got, _ = tiny(tokens, None, soft_eviction_backend(keep, jax.random.key(0), 2, 8, 0.5), ())
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=1e-5)

    def streaming(layer, q, k, v, pos, state):
        t, s = pos[:, None, :], pos[:, :, None]
        return dense_attention(q, k, v, pos, pos, visible_BST=(t < 2) | (t > s - 8))[0], state

    want, _ = tiny(tokens, None, streaming, None)
    evict = init_decisions(tiny.config, 60.0)
    got, _ = tiny(tokens, None, soft_eviction_backend(evict, jax.random.key(0), 2, 8, 0.05), ())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-3)
    assert np.abs(np.asarray(want) - np.asarray(dense)).max() > 1e-2


@pytest.mark.integration        # three training runs: make test, not the test-fast loop
def test_training_raises_the_eviction_rate_and_resumes_exactly(tiny, tmp_path):
    rs = np.random.RandomState(1)
    data = [(rs.randint(3, 97, (2, 64)), np.ones((2, 64))) for _ in range(8)]
    cfg = DMSConfig(steps=8, seq_len=64, batch_size=2, lr=0.2, target=0.5, ramp=0.5, sinks=2, window=8,
                    save_every=4, work_dir=str(tmp_path / "a"))
    whole = train_decisions(tiny, lambda i: data[i], cfg, progress=False)
    rates = [r for _, _, r in whole["history"]]
    assert rates[-1] > rates[0] + 0.05
    other = dataclasses.replace(cfg, work_dir=str(tmp_path / "b"))

    def killed_at_5(i):
        if i == 5:
            raise KeyboardInterrupt          # a stop after the step-4 save
        return data[i]

    with pytest.raises(KeyboardInterrupt):
        train_decisions(tiny, killed_at_5, other, progress=False)
    resumed = train_decisions(tiny, lambda i: data[i], other, progress=False)
    np.testing.assert_allclose(resumed["w"], whole["w"], atol=1e-6)
    np.testing.assert_allclose(resumed["history"], whole["history"], rtol=1e-5)


def test_export_loads_back_as_the_policy(tiny, tmp_path):
    rs = np.random.RandomState(2)
    w, b = rs.randn(2, 2, 32).astype(np.float32), rs.randn(2, 2).astype(np.float32)
    pol = kvjax.load_scorers(export_decisions(w, b, tmp_path / "dms", sinks=2, window=8, base_config=tiny.config),
                             model=tiny)
    assert pol.name == "dms"
    k, v = rs.randn(1, 5, 2, 16).astype(np.float32), rs.randn(1, 5, 2, 16).astype(np.float32)
    want = -(np.einsum("bskx,kx->bks", np.concatenate([k, v], -1), w[1]) + b[1][None, :, None])
    np.testing.assert_allclose(np.asarray(pol.priority(pol.params, 1, k, v, None)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dms_logits(w[1], b[1], k, v)), -want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs trained decisions"):
        kvjax.generate(tiny, [[5, 6, 7]], 2, policy=kvjax.make_policy("dms", kvjax.EvictionConfig(2, 4, 2)),
                       eos_token_id=[])
    with pytest.raises(ValueError, match="need finite w"):
        export_decisions(w[0], b, tmp_path / "bad", sinks=2, window=8)


def test_trace_batches_are_seeded_cut_and_masked(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"tokens": list(range(100 * i + 1, 100 * i + n))}) + "\n"
                            for i, n in enumerate((10, 30, 50))))
    batch_at = trace_batches(path, 20, 2, seed=3)
    tokens, mask = batch_at(0)
    assert tokens.shape == (2, 20) and np.array_equal(batch_at(0)[0], tokens)
    for row, m in zip(tokens, mask):
        n = int((row > 0).sum())
        assert m.sum() == n - 1 and row[:n].tolist() == list(range(row[0], row[0] + n))
    seen = {tuple(batch_at(s)[0][i]) for s in range(3) for i in range(2)}
    assert len(seen) == 3                                  # an epoch visits every trace
    with pytest.raises(ValueError, match="dms: need 0 < target < 1"):
        DMSConfig(target=1.5)


def test_kept_fractions_count_the_keep_decisions_and_the_ragged_memory(tiny):
    from kvjax.dms.memory import kept_fractions, ragged_memory

    rs = np.random.RandomState(4)
    L, K = tiny.config.num_layers, tiny.config.num_kv_heads
    b = np.zeros((L, K), np.float32)
    b[0, 0], b[1, 1] = -1e6, 1e6                                        # head (0,0) keeps all, (1,1) none
    pol = kvjax.make_policy("dms", kvjax.EvictionConfig(2, 8, 4), params={"w": jnp.zeros((L, K, 32)), "b": jnp.asarray(b)})
    seqs = [rs.randint(3, 97, n).tolist() for n in (40, 60, 5)]          # the 5-token one has nothing to evict
    f = kept_fractions(tiny, pol, seqs, sinks=2, window=8)
    assert f.shape == (2, L, K) and (f[:, 0, 0] == 1).all() and (f[:, 1, 1] == 0).all()
    mem = ragged_memory(f, [40, 60], sinks=2, window=8)
    assert mem["max_slots"] == 60 and mem["fixed_over_ragged"] > 1


@pytest.mark.integration        # a training run, an export and a measurement: make test, not the test-fast loop
def test_run_dms_trains_exports_and_measures_the_ragged_memory(tiny, tmp_path):
    from kvjax.dms.train import run_dms

    rs = np.random.RandomState(5)
    for name, n in (("train", 6), ("valid", 3)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"tokens": rs.randint(3, 97, 50).tolist()}) + "\n"
                                                        for _ in range(n)))
    cfg = DMSConfig(steps=3, seq_len=48, batch_size=2, sinks=2, window=8, traces=str(tmp_path / "train.jsonl"),
                    valid_traces=str(tmp_path / "valid.jsonl"), work_dir=str(tmp_path / "w"),
                    out_dir=str(tmp_path / "out"))
    out = run_dms(cfg, model=tiny, progress=False)
    assert len(out["history"]) == 3 and out["ragged_memory"]["sequences"] == 3
    pol = kvjax.load_scorers(tmp_path / "out", model=tiny)
    np.testing.assert_allclose(np.asarray(pol.params["b"]), out["b"])
    assert json.loads((tmp_path / "out" / "ragged_memory.json").read_text())["max_slots"] <= 50


@pytest.mark.integration        # a 26 s training run: make test, not the test-fast loop
def test_run_dms_on_the_testbed_trains_on_its_problems(tmp_path):
    """``testbed:`` replaces the traces: training rows are train-split problems and the ragged
    memory is measured on 64 valid-split problems."""
    from flax import nnx

    from kvjax.data import VOCAB_SIZE
    from kvjax.dms.train import run_dms

    cfg_m = kvjax.ModelConfig("llama", VOCAB_SIZE, 32, 64, 2, 4, 2, 16, max_position_embeddings=256)
    model = kvjax.Decoder(cfg_m, rngs=nnx.Rngs(0))
    tb = {"length": 128, "num_names": 16}
    cfg = DMSConfig(steps=2, seq_len=128, batch_size=2, sinks=2, window=8, testbed=tb, work_dir=str(tmp_path / "w"),
                    out_dir=str(tmp_path / "out"), traces="missing.jsonl")
    out = run_dms(cfg, model=model, progress=False)
    assert len(out["history"]) == 2 and out["ragged_memory"]["sequences"] == 64
    assert kvjax.load_scorers(tmp_path / "out", model=model).name == "dms"
    with pytest.raises(ValueError, match="seq_len 100 is shorter than the testbed's problems"):
        DMSConfig(seq_len=100, testbed=tb)
    with pytest.raises(ValueError, match="testbed training needs model_dir"):
        run_dms(DMSConfig(testbed=tb), progress=False)
