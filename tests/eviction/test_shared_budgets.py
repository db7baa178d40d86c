"""Budgets shared across heads and layers for every ranker in prefill compression: per-head
normalisation, the kept sets against a brute force, one pass (``generate``) against the shared
prefill, and the errors where a shared budget cannot run."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.eviction.prompt_compressed import head_normalised, prompt_compressed, shared_keep_context


@pytest.fixture(scope="module")
def tiny(hf_dir):
    return kvjax.load_hf(hf_dir("qwen3-gqa")[0])


def test_zscore_standardises_each_head_over_its_eligible_tokens_only():
    rs = np.random.RandomState(0)
    prio = (rs.randn(2, 3, 2, 20) * np.array([1.0, 50.0])[None, None, :, None] + 7).astype(np.float32)
    elig = np.zeros((2, 1, 1, 20), bool)
    elig[0, ..., 2:15] = True
    elig[1, ..., 5:9] = True
    got = np.asarray(head_normalised(jnp.asarray(prio), jnp.asarray(elig), "zscore"))
    for b in range(2):
        e = elig[b, 0, 0]
        x = prio[b][..., e].astype(np.float64)
        want = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)
        np.testing.assert_allclose(got[b][..., e], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(got[b][..., ~e], prio[b][..., ~e])      # others untouched
    np.testing.assert_array_equal(np.asarray(head_normalised(jnp.asarray(prio), jnp.asarray(elig), "none")), prio)
    with pytest.raises(ValueError, match="head_norm must be 'none' or 'zscore'"):
        head_normalised(jnp.asarray(prio), jnp.asarray(elig), "rank")


def test_a_zscored_shared_budget_is_one_top_k_of_standardised_priorities():
    """A head shifted by +100 takes all its tokens unnormalised; z-scored, the
    kept set is the brute-force top-k of each head's standardised priorities."""
    rs = np.random.RandomState(3)
    L, B, K, S, s, w = 2, 2, 3, 40, 2, 4
    prio = rs.randn(L, B, K, S).astype(np.float32)
    prio[1, :, 2] += 100.0
    context, keep = np.array([40, 31]), np.array([16, 12])
    raw = np.asarray(shared_keep_context(jnp.asarray(prio), jnp.asarray(context), jnp.asarray(keep), sinks=s,
                                         window=w, scope="global"))
    z = np.asarray(shared_keep_context(jnp.asarray(prio), jnp.asarray(context), jnp.asarray(keep), sinks=s,
                                       window=w, scope="global", norm="zscore"))
    for b in range(B):
        n = context[b]
        elig = np.zeros(S, bool)
        elig[s:n - w] = True
        n_top = L * K * (keep[b] - s - w)
        x = prio[:, b][..., elig].astype(np.float64)
        zs = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)
        assert set(np.flatnonzero(z[:, b][..., elig].ravel())) == set(np.argsort(-zs.ravel())[:n_top])
        assert z[:, b][..., elig].sum() == raw[:, b][..., elig].sum() == n_top
        per_head_raw = raw[:, b][..., elig].sum(-1)
        assert per_head_raw[1, 2] == elig.sum()                    # the shifted head keeps everything
        assert z[:, b][..., elig].sum(-1)[1, 2] < elig.sum() / 2


def test_head_norm_follows_the_ranker_unless_set():
    ev = kvjax.EvictionConfig(2, 4, 8, budgets="global", prefill="compressed")
    assert prompt_compressed(kvjax.make_policy("knorm", ev), 0.5, [40]).head_norm == "zscore"
    assert prompt_compressed(kvjax.make_policy("keydiff", ev), 0.5, [40]).head_norm == "zscore"
    oracle = kvjax.make_policy("oracle", ev, params=jnp.zeros((2, 1, 2, 40)))
    assert prompt_compressed(oracle, 0.5, [40]).head_norm == "none"
    fixed = kvjax.make_policy("knorm", dataclasses.replace(ev, head_norm="none"))
    assert prompt_compressed(fixed, 0.5, [40]).head_norm == "none"
    with pytest.raises(ValueError, match="head_norm must be one of"):
        kvjax.EvictionConfig(2, 4, 8, head_norm="softmax")


@pytest.mark.parametrize("levels", [False, True])
def test_a_scorers_head_norm_follows_its_fit_through_export(tiny, tmp_path, levels):
    """A centred fit learns each head's ranking up to an offset: z-scored under a shared budget;
    a fit of the target's levels (``levels``) compares as it is. The export records which, and
    exports written before the field load as centred."""
    import json

    from kvjax.eviction.learned import from_scorer
    from kvjax.scorers import MLPScorer

    cfg = tiny.config
    ev = kvjax.EvictionConfig(2, 4, 8, budgets="global", prefill="compressed")
    policy = from_scorer(MLPScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, rngs=nnx.Rngs(0)), ev,
                         levels=levels)
    want = "none" if levels else "zscore"
    assert prompt_compressed(policy, 0.5, [40]).head_norm == want
    kvjax.export_scorers(policy, tmp_path / "x", base_config=cfg)
    meta = json.loads((tmp_path / "x" / "scorer_config.json").read_text())
    assert meta["levels"] is levels
    loaded = kvjax.load_scorers(tmp_path / "x", model=tiny, compression=None, config=ev)
    assert loaded.levels is levels and prompt_compressed(loaded, 0.5, [40]).head_norm == want
    del meta["levels"]
    (tmp_path / "x" / "scorer_config.json").write_text(json.dumps(meta))
    old = kvjax.load_scorers(tmp_path / "x", model=tiny, compression=None, config=ev)
    assert old.levels is False and prompt_compressed(old, 0.5, [40]).head_norm == "zscore"


def _scorer_policy(cfg, ev):
    from kvjax.eviction.learned import from_scorer
    from kvjax.scorers import MLPScorer

    return from_scorer(MLPScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, rngs=nnx.Rngs(0)), ev)


@pytest.mark.integration        # compiles generate and the shared prefill per ranker: make test, not test-fast
def test_generate_and_the_shared_prefill_keep_the_same_shared_budget(tiny):
    """``generate`` gathers every layer's priorities from a dense context pass and keeps one top-k;
    ``shared_prefill.compress`` gathers them from its own prefill: the same kept sets (the whole
    budget, ``L K (c - s - w)`` long-range tokens per row) and the same tokens, for K-norm, KeyDiff,
    random and a KVpop scorer, under both scopes."""
    from kvjax.eviction.shared_prefill import answer, compress, prefill_context
    from kvjax.sampling import bucket

    cfg = tiny.config
    rs = np.random.RandomState(5)
    ctx = [rs.permutation(np.arange(3, 97))[:n].tolist() for n in (56, 43)]
    qs = [rs.randint(3, 97, n).tolist() for n in (4, 7)]
    n, new, ratio = [len(c) for c in ctx], 5, 0.75
    pre = prefill_context(tiny, ctx, cache_len=bucket(64) + bucket(new), keep_queries=True)
    s, w = 2, 4
    for scope in ("global", "layer"):
        ev = kvjax.EvictionConfig(s, w, 8, budgets=scope)
        for name in ("knorm", "keydiff", "random", "kvpop_mlp"):
            ranker = _scorer_policy(cfg, ev) if name == "kvpop_mlp" else kvjax.make_policy(name, ev)
            pol = prompt_compressed(ranker, ratio, n)
            cache = compress(pol, tiny, pre)
            c = np.round((1 - ratio) * np.asarray(n)).astype(int)
            for b in range(2):
                kept = np.stack([np.asarray(k[b, :, s:n[b] - w]) for k in cache.keep])      # [L, K, eligible]
                per = kept.sum(axis=(1, 2)) if scope == "layer" else [kept.sum()]
                want = (1 if scope == "layer" else cfg.num_layers) * cfg.num_kv_heads * (c[b] - s - w)
                assert all(p == want for p in per), f"{name} {scope} row {b}: {per} long-range tokens, want {want}"
            prepared = pol.prepare(tiny, np.asarray([c_ + [0] * (56 - len(c_)) for c_ in ctx]), np.asarray(n))
            from kvjax import decode

            one = decode.open_cache(prepared, prepared.params, cfg, 2, cache.keep[0].shape[-1], tiny.dtype,
                                    prepared.params["context"])
            for layer in range(cfg.num_layers):
                np.testing.assert_array_equal(np.asarray(one.keep[layer]), np.asarray(cache.keep[layer]),
                                              err_msg=f"{name} {scope} layer {layer}")
            want_tokens = np.asarray(kvjax.generate(tiny, [a + q for a, q in zip(ctx, qs)], new, policy=pol,
                                                    eos_token_id=[]))[:, -new:]
            got = answer(tiny, cache, qs, n, new, eos_ids=[])
            np.testing.assert_array_equal(got, want_tokens, err_msg=f"{name} {scope}")


def test_a_shared_budget_refuses_what_it_cannot_rank(tiny):
    ctx = [list(range(3, 60))]
    ev = kvjax.EvictionConfig(2, 4, 8, budgets="global")
    with pytest.raises(ValueError, match="an attention statistic needs the prompt's queries"):
        kvjax.generate(tiny, ctx, 2, policy=prompt_compressed(kvjax.make_policy("snapkv", ev), 0.75, [57]))
    with pytest.raises(ValueError, match="runs in prefill compression"):
        kvjax.generate(tiny, ctx, 2, policy=kvjax.make_policy("knorm", ev))
    cfg = tiny.config           # an oracle's table is known first, but it makes no per-head split
    oracle = kvjax.make_policy("oracle", ev, params=jnp.zeros((cfg.num_layers, 1, cfg.num_kv_heads, 64)))
    with pytest.raises(ValueError, match="'oracle' does not split"):
        kvjax.generate(tiny, ctx, 2, policy=oracle)
