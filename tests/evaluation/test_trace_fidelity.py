"""Trace fidelity: records equal a direct computation, the run resumes, budgets are exact."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.evaluation.results_store import read_records
from kvjax.evaluation.trace_fidelity import FidelityConfig, _compare, budget, crop_of, markdown, run_fidelity
from kvjax.eviction.forced import sparse_logits
from kvjax.eviction.policies import make_policy


@pytest.fixture(scope="module")
def model():
    cfg = kvjax.ModelConfig("llama", 97, 32, 64, 2, 4, 2, 16, max_position_embeddings=512)
    return kvjax.Decoder(cfg, rngs=nnx.Rngs(0), init_std=0.3, embed_init_std=1.0)


def test_budget_and_crop():
    cfg = FidelityConfig(crops=[64, 96], compressions=[0.5, 0.75], sinks=2, window=4)
    ev = budget(cfg, 96, 0.75)
    assert ev.sinks + ev.window + ev.topk == 24
    assert crop_of(95, cfg.crops) == 64 and crop_of(96, cfg.crops) == 96 and crop_of(63, cfg.crops) is None
    with pytest.raises(ValueError, match="leaves 8 slots, not more than sinks \\+ window = 36"):
        FidelityConfig(crops=[64], compressions=[0.88], sinks=4, window=32)


def test_compare_counts_only_the_assistant_positions():
    rs = np.random.RandomState(0)
    a = jnp.asarray(rs.randn(2, 10, 7).astype(np.float32))
    tokens = rs.randint(0, 7, (2, 10))
    agree, kl, nll, n = _compare(a, a, jnp.asarray([3, 0]), tokens)
    assert n.tolist() == [6, 9] and agree.tolist() == [6, 9] and np.allclose(kl, 0, atol=1e-6)
    logp = np.asarray(a) - np.log(np.exp(np.asarray(a)).sum(-1, keepdims=True))
    want = [-sum(logp[b, s, tokens[b, s + 1]] for s in range(start, 9)) for b, start in enumerate([3, 0])]
    np.testing.assert_allclose(nll, want, rtol=1e-5)


@pytest.mark.integration        # an evaluation run, stopped and resumed: make test, not the test-fast loop
def test_records_equal_a_direct_computation_and_the_run_resumes(model, tmp_path):
    rs = np.random.RandomState(1)
    f = tmp_path / "t.jsonl"
    lengths = [70, 100, 64, 40]                     # the last is shorter than every crop: skipped
    f.write_text("".join(json.dumps({"id": f"t{i}", "tokens": rs.randint(0, 97, n).tolist(), "prompt_len": 10})
                         + "\n" for i, n in enumerate(lengths)))
    cfg = FidelityConfig(traces=[str(f)], out_dir=str(tmp_path / "out"), policies=["streaming_llm", "knorm"],
                         compressions=[0.5], crops=[64, 96], sinks=2, window=4, batch_size=2)
    tab = run_fidelity(cfg, model=model, progress=False)
    assert tab[0.5]["knorm"]["n"] == 3 and tab[0.5]["streaming_llm"]["n"] == 3
    recs = read_records(tmp_path / "out")
    r = next(r for r in recs if r["id"] == "t1" and r["policy"] == "knorm")
    assert r["crop"] == 96
    tokens = jnp.asarray([json.loads(f.read_text().splitlines()[1])["tokens"][:96]], jnp.int32)
    pol = make_policy("knorm", budget(cfg, 96, 0.5))
    agree, kl, _, n = _compare(kvjax.forward(model, tokens), sparse_logits(model, tokens, pol), jnp.asarray([10]),
                               tokens)
    assert r["top1"] == [int(agree[0]), int(n[0])] and r["kl"] == pytest.approx(float(kl[0]), rel=1e-5)
    assert 0 < r["top1"][0] < r["top1"][1] == 85
    before = (tmp_path / "out" / "problems.jsonl.gz").read_bytes()
    again = run_fidelity(cfg, model=model, progress=False)           # everything stored: nothing recomputed
    assert (tmp_path / "out" / "problems.jsonl.gz").read_bytes() == before and again == tab
    assert "| knorm (N=3) |" in markdown(tab)


@pytest.mark.integration        # an evaluation run with an adapted backbone: make test
def test_an_adapted_backbone_is_judged_against_the_original_dense_model(model, tmp_path):
    import dataclasses

    import jax

    from kvjax.eviction.config import EvictionConfig
    from kvjax.eviction.learned import from_scorer
    from kvjax.scorers import MLPScorer

    rs = np.random.RandomState(2)
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"id": f"t{i}", "tokens": rs.randint(0, 97, 70).tolist(), "prompt_len": 5})
                         + "\n" for i in range(3)))
    adapted = nnx.clone(model)                      # "trained": every weight moved a little
    state = nnx.state(adapted)
    leaves, tree = jax.tree.flatten(state)
    noise = [x + 0.05 * jax.random.normal(jax.random.key(i), x.shape, x.dtype) for i, x in enumerate(leaves)]
    nnx.update(adapted, jax.tree.unflatten(tree, noise))
    kvjax.save_hf(adapted, tmp_path / "student")
    scorer = MLPScorer(2, 2, 16, 8, rngs=nnx.Rngs(5))
    kvjax.export_scorers(from_scorer(scorer, EvictionConfig(sinks=2, window=4, topk=10)), tmp_path / "scorers",
                         base_config=model.config)
    cfg = FidelityConfig(traces=[str(f)], out_dir=str(tmp_path / "out"), policies=["dense", "knorm"],
                         adapted={"a": {"model": str(tmp_path / "student"), "scorers": str(tmp_path / "scorers")}},
                         adapted_policies=["knorm"], compressions=[0.5], crops=[64], sinks=2, window=4, batch_size=3)
    tab = run_fidelity(cfg, model=model, progress=False)[0.5]
    assert set(tab) == {"dense", "knorm", "a", "a/dense", "a/knorm"}
    tokens = jnp.asarray([json.loads(x)["tokens"][:64] for x in f.read_text().splitlines()], jnp.int32)
    starts = jnp.asarray([5, 5, 5])
    ref = kvjax.forward(model, tokens)
    back = kvjax.load_hf(tmp_path / "student")
    ev = budget(cfg, 64, 0.5)
    own = kvjax.load_scorers(tmp_path / "scorers", model=back).at_budget(ev, context=64)
    for name, logits in [("dense", ref), ("a/dense", kvjax.forward(back, tokens)),
                         ("a/knorm", sparse_logits(back, tokens, make_policy("knorm", ev))),
                         ("a", sparse_logits(back, tokens, own))]:
        agree, kl, nll, n = _compare(ref, logits, starts, tokens)
        assert tab[name]["top1"] == pytest.approx(float(np.mean(agree / n)), abs=1e-6), name
        assert tab[name]["kl"] == pytest.approx(float(np.mean(kl / n)), rel=1e-4, abs=1e-6), name
        assert tab[name]["nll"] == pytest.approx(float(np.mean(nll / n)), rel=1e-5), name
    assert tab["dense"]["top1"] == 1.0 and tab["a/dense"]["top1"] < 1.0 and tab["a/dense"]["kl"] > 1e-3
    assert tab["dense"]["ppl"] == pytest.approx(np.exp(tab["dense"]["nll"]))
    assert "ppl @ 50%" in markdown({0.5: tab}) and "| a/dense (N=3) |" in markdown({0.5: tab})
    with pytest.raises(ValueError, match="adapted.a: give .* unknown key 'scorer'"):
        dataclasses.replace(cfg, adapted={"a": {"model": "x", "scorer": "y"}})
    with pytest.raises(ValueError, match="adapted_policies: oracle reads the original model's attention"):
        dataclasses.replace(cfg, adapted_policies=["oracle"])
