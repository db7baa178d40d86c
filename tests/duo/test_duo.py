"""DuoAttention: the gated attention is full attention at gates 1 and streaming attention at
gates 0, training resumes exactly, budgets total the uniform budget, the export loads back,
and the passkey data puts the answer where the loss reads it."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import kvjax
from kvjax.duo.passkey import passkey_sequence
from kvjax.duo.train import DuoConfig, export_gates, mixed_attention_backend, train_gates
from kvjax.eviction.duo_attention import duo_budgets
from kvjax.models.attention import dense_attention
from kvjax.real_model import ensure_model


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


def test_gates_one_are_full_attention_and_gates_zero_streaming(tiny):
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 97, (2, 80)))
    dense, _ = tiny(tokens)
    L, K = tiny.config.num_layers, tiny.config.num_kv_heads
    full, _ = tiny(tokens, None, mixed_attention_backend(2, 8), jnp.ones((L, K)))
    np.testing.assert_allclose(np.asarray(full), np.asarray(dense), atol=1e-5)

    def streaming(layer, q, k, v, pos, state):
        t, s = pos[:, None, :], pos[:, :, None]
        return dense_attention(q, k, v, pos, pos, visible_BST=(t < 2) | (t > s - 8))[0], state

    want, _ = tiny(tokens, None, streaming, None)
    got, _ = tiny(tokens, None, mixed_attention_backend(2, 8), jnp.zeros((L, K)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert np.abs(np.asarray(got) - np.asarray(dense)).max() > 1e-2          # streaming really differs


@pytest.mark.integration        # training runs, stopped and resumed: make test, not the test-fast loop
def test_training_lowers_unneeded_gates_and_resumes_exactly(tiny, tmp_path):
    rs = np.random.RandomState(1)
    data = [(rs.randint(3, 97, (1, 64)), np.r_[np.zeros(48), np.ones(16)][None]) for _ in range(6)]
    cfg = DuoConfig(steps=6, lr=0.05, reg=0.05, sinks=2, window=8, save_every=3, work_dir=str(tmp_path / "a"))
    whole = train_gates(tiny, lambda i: data[i], cfg, progress=False)
    assert np.all(whole["gates"] <= 1.0) and np.all(whole["gates"] >= 0.0) and whole["gates"].mean() < 1.0
    half = dataclasses.replace(cfg, steps=3, work_dir=str(tmp_path / "b"))
    train_gates(tiny, lambda i: data[i], half, progress=False)
    resumed = train_gates(tiny, lambda i: data[i], dataclasses.replace(half, steps=6), progress=False)
    np.testing.assert_allclose(resumed["gates"], whole["gates"], atol=1e-6)
    np.testing.assert_allclose(resumed["history"], whole["history"], rtol=1e-5)


@pytest.mark.parametrize("topk, cap", [(10, 40), (10, 10), (7, 30), (0, 30)])
def test_duo_budgets_total_the_uniform_budget_and_favour_large_gates(topk, cap):
    gates = np.random.RandomState(2).rand(6, 3)
    b = np.asarray(duo_budgets(gates, topk, cap))
    assert b.sum() == gates.size * topk and b.max() <= cap
    order = np.argsort(-gates.reshape(-1), kind="stable")
    assert (np.diff(b.reshape(-1)[order]) <= 0).all()                        # larger gate, no fewer slots
    with pytest.raises(ValueError, match="cap k_max=5 is below topk=10"):
        duo_budgets(gates, 10, 5)


def test_export_loads_back_and_needs_a_cap(tiny, tmp_path):
    gates = np.random.RandomState(3).rand(2, 2).astype(np.float32)
    out = export_gates(gates, tmp_path / "duo", sinks=2, window=8, base_config=tiny.config)
    pol = kvjax.load_scorers(out, model=tiny)                      # 75% of each prompt evicted
    assert pol.name == "duo_attention" and pol.compression == 0.75
    np.testing.assert_array_equal(np.asarray(pol.params["gates"]), gates)
    with pytest.raises(ValueError, match="exported without a long-range budget"):
        kvjax.load_scorers(out, model=tiny, compression=None)
    assert kvjax.generate(tiny, [[5, 6, 7] * 10], 2, policy=pol, eos_token_id=[]).shape == (1, 32)
    with pytest.raises(ValueError, match="set EvictionConfig.k_max"):
        dataclasses.replace(pol.at_budget(kvjax.EvictionConfig(2, 8, 4), context=30),
                            config=kvjax.EvictionConfig(2, 8, 4)).effective()
    ev = kvjax.EvictionConfig(sinks=2, window=8, topk=4, k_max=8)
    capped = pol.at_budget(ev)
    b = np.asarray(capped.head_budgets(capped.params, tiny.config, 1))[:, 0]
    assert sorted(b.reshape(-1).tolist()) == [0, 0, 8, 8]
    assert b.reshape(-1)[np.argsort(-gates.reshape(-1))[:2]].tolist() == [8, 8]
    with pytest.raises(ValueError, match="needs trained gates"):
        kvjax.generate(tiny, [[5, 6, 7]], 2, policy=kvjax.make_policy("duo_attention", ev), eos_token_id=[])


def test_passkey_sequences_end_with_the_keys_they_hide():
    tok = transformers.AutoTokenizer.from_pretrained(ensure_model())
    ids, start = passkey_sequence(tok, 512, 0, n_keys=5)
    assert 400 < len(ids) <= 512
    text, answer = tok.decode(ids[:start]), tok.decode(ids[start:])
    keys = answer.removeprefix("The pass keys are ").rstrip(".").split(", ")
    assert len(keys) == 5 and all(f"The pass key is {k}." in text for k in keys)
    assert [text.index(f"pass key is {k}") for k in keys] == sorted(text.index(f"pass key is {k}") for k in keys)
    assert passkey_sequence(tok, 512, 0, n_keys=5) == (ids, start)
    assert passkey_sequence(tok, 512, 1, n_keys=5)[0] != ids
    with pytest.raises(ValueError, match="too short"):
        passkey_sequence(tok, 100, 0)


@pytest.mark.integration        # a training and evaluation run: make test, not the test-fast loop
def test_run_duo_on_the_testbed_and_the_evaluations_cap(tmp_path):
    """``testbed:`` trains the gates on testbed problems (the lookups and the answer line in the
    loss); ``at_budget`` gives retrieval heads the whole context as their cap."""
    from flax import nnx

    from kvjax.data import VOCAB_SIZE
    from kvjax.duo.train import run_duo

    cfg_m = kvjax.ModelConfig("llama", VOCAB_SIZE, 32, 64, 2, 4, 2, 16, max_position_embeddings=256)
    model = kvjax.Decoder(cfg_m, rngs=nnx.Rngs(0))
    tb = {"length": 128, "num_names": 16}
    cfg = DuoConfig(steps=2, length=128, batch_size=2, sinks=2, window=8, testbed=tb, work_dir=str(tmp_path / "w"),
                    out_dir=str(tmp_path / "out"))
    out = run_duo(cfg, model=model, progress=False)
    assert len(out["history"]) == 2 and np.asarray(out["gates"]).shape == (2, 2)
    pol = kvjax.load_scorers(tmp_path / "out", model=model)
    ev = kvjax.EvictionConfig(sinks=4, window=8, topk=20)
    assert pol.at_budget(ev, context=160).config.k_max == 148
    with pytest.raises(ValueError, match="give the context length"):
        pol.at_budget(ev)
    with pytest.raises(ValueError, match="length 64 is shorter than the testbed's problems"):
        DuoConfig(length=64, testbed=tb)
    with pytest.raises(ValueError, match="testbed training needs model_dir"):
        run_duo(DuoConfig(length=128, testbed=tb), progress=False)
