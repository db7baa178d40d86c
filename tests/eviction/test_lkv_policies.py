"""LKV in the bounded cache: per-head budgets in the keep rule (prefill = decode), the
``lkv`` and ``lkv_kvpop_mlstm`` policies, and the soft keep weights LKV trains with."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.eviction import keep_mask
from kvjax.eviction.keep_rule import keep_mask_heads
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.forced import sparse_logits, stepwise_logits
from kvjax.eviction.lkv_policies import LKV, LKVBudgetsKVpopMLSTM, lkv_budgets_policy, lkv_policy
from kvjax.lkv import LKVHeads, LKVTokenScorer
from kvjax.lkv.soft_mask import soft_keep_weights, soft_masked_attention
from kvjax.scorers import MLSTMScorer


@pytest.fixture(scope="module")
def tiny(hf_dir):
    return kvjax.load_hf(hf_dir("qwen3-gqa")[0])


def test_per_head_budgets_keep_exactly_each_heads_top_b():
    rs = np.random.RandomState(0)
    prio = rs.randn(2, 3, 70).astype(np.float32)
    budgets = np.array([[0, 5, 80], [12, 1, 30]])
    got = np.asarray(keep_mask_heads(jnp.asarray(prio), sinks=3, window=6, topk=jnp.asarray(budgets)))
    for b in range(2):
        for h in range(3):
            want = np.asarray(keep_mask(prio[b, h], sinks=3, window=6, topk=int(budgets[b, h])))
            np.testing.assert_array_equal(got[b, h], want)


def _random_lkv(cfg, ev, budgets, seed=0):
    tokens = LKVTokenScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, rngs=nnx.Rngs(seed))
    tdef, tparams = nnx.split(tokens)
    return LKV(ev, params={"budgets": jnp.asarray(budgets, jnp.int32), "tokens": nnx.to_pure_dict(tparams)},
               tokens_def=tdef)


@pytest.mark.parametrize("combo", [False, True])
def test_sparse_pass_equals_stepwise_decode_with_per_head_budgets(tiny, combo):
    """Train = decode with unequal budgets: head (l, h) keeps b_lh long-range tokens in both paths."""
    cfg = tiny.config
    ev = EvictionConfig(sinks=2, window=6, topk=8, k_max=14)
    budgets = [[0, 14], [5, 11]]
    if combo:
        sc = MLSTMScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, rngs=nnx.Rngs(3))
        sdef, sparams = nnx.split(sc)
        pol = LKVBudgetsKVpopMLSTM(ev, params={"budgets": jnp.asarray(budgets, jnp.int32),
                                               "scorer": nnx.to_pure_dict(sparams)}, scorer_def=sdef)
    else:
        pol = _random_lkv(cfg, ev, budgets)
    tokens = np.random.RandomState(1).randint(3, 97, (2, 80))
    a = np.asarray(sparse_logits(tiny, tokens, pol))
    b = np.asarray(stepwise_logits(tiny, tokens, pol))
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    dense = np.asarray(kvjax.forward(tiny, tokens))
    assert np.abs(a - dense).max() > 1e-2
    cache = pol.init(pol.params, cfg, 2, 80, jnp.float32, jnp.full((2,), 80))
    assert cache.layers[0].k.shape[2] == cache.layers[0].pos.shape[2] == 2 + 6 + 14   # s + w + k_max slots
    np.testing.assert_array_equal(np.asarray(cache.layers[1].budget), [[5, 11], [5, 11]])


def test_builders_budgets_sum_and_errors(tiny):
    cfg = tiny.config
    heads = LKVHeads(cfg.num_layers, cfg.num_kv_heads, 8, 16, rngs=nnx.Rngs(0))
    heads.w2.set_value(jax.random.normal(jax.random.key(1), heads.w2.shape))   # unequal scores
    ev = EvictionConfig(sinks=2, window=6, topk=10, k_max=25)
    tokens = LKVTokenScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, rngs=nnx.Rngs(0))
    pol = lkv_policy(heads, tokens, ev)
    b = np.asarray(pol.params["budgets"])
    assert b.shape == (cfg.num_layers, cfg.num_kv_heads)
    assert b.sum() <= cfg.num_layers * cfg.num_kv_heads * 10 and (b <= 25).all() and len(set(b.ravel())) > 1
    sc = MLSTMScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, rngs=nnx.Rngs(3))
    combo = lkv_budgets_policy(heads, sc, ev)
    np.testing.assert_array_equal(np.asarray(combo.params["budgets"]), b)
    out = kvjax.generate(tiny, [[5, 9, 11, 40, 3, 7]], 30, policy=combo, eos_token_id=[])
    assert out.shape == (1, 36)
    with pytest.raises(ValueError, match="0 < topk < k_max"):
        lkv_policy(heads, tokens, EvictionConfig(sinks=2, window=6, topk=10))
    with pytest.raises(TypeError, match="expected an MLSTMScorer"):
        lkv_budgets_policy(heads, tokens, ev)
    with pytest.raises(ValueError, match="needs trained LKV weights"):
        kvjax.generate(tiny, [[5, 9, 11]], 4, policy=kvjax.make_policy("lkv", ev))
    bad = _random_lkv(cfg, ev, [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"budgets have shape \(1, 3\)"):
        kvjax.generate(tiny, [[5, 9, 11]], 4, policy=bad)


def test_soft_keep_weights_sum_to_budget_and_reach_the_hard_rule():
    rs = np.random.RandomState(2)
    u = jnp.asarray(rs.randn(2, 2, 40).astype(np.float32))
    budget = jnp.asarray([[3.0, 7.5], [0.0, 50.0]])
    w = np.asarray(soft_keep_weights(u, budget, sinks=2, window=4, temperature=0.3))
    q, t = np.arange(40)[:, None], np.arange(40)[None]
    eligible = (t >= 2) & (t <= q - 4)
    n_elig = eligible.sum(-1)
    assert ((w >= 0) & (w <= 1)).all() and (w[:, :, t > q] == 0).all()
    always = (t <= q) & ~eligible
    assert (w[:, :, always] == 1).all()
    for b_row, h, b in [(0, 0, 3.0), (0, 1, 7.5)]:
        s = (w[b_row, h] * eligible).sum(-1)
        np.testing.assert_allclose(s[n_elig > b], b, atol=1e-4)
        np.testing.assert_array_equal(w[b_row, h][(n_elig <= b)[:, None] & eligible], 1.0)
    assert (w[1, 0][eligible] == 0).all() and (w[1, 1][eligible] == 1).all()
    # temperature -> 0 with integer budgets: exactly the keep rule with priorities u
    hard = np.asarray(soft_keep_weights(u, jnp.asarray([[3.0, 5.0], [1.0, 9.0]]), sinks=2, window=4,
                                        temperature=1e-4))
    want = np.asarray(keep_mask_heads(u, sinks=2, window=4, topk=jnp.asarray([[3, 5], [1, 9]])))
    np.testing.assert_array_equal(hard > 0.5, want)
    assert np.abs(hard - want).max() < 1e-3


def test_soft_masked_attention_gradients_reach_scores_and_budget():
    rs = np.random.RandomState(3)
    q = jnp.asarray(rs.randn(1, 24, 4, 8).astype(np.float32))
    k = jnp.asarray(rs.randn(1, 24, 2, 8).astype(np.float32))
    v = jnp.asarray(rs.randn(1, 24, 2, 8).astype(np.float32))
    u = jnp.asarray(rs.randn(1, 2, 24).astype(np.float32))
    noise = jax.random.gumbel(jax.random.key(0), u.shape)

    def f(u, b):
        w = soft_keep_weights(u, b, sinks=1, window=3, temperature=0.7, noise_BKS=noise)
        return jnp.sum(soft_masked_attention(q, k, v, w) ** 2)

    gu, gb = jax.grad(f, argnums=(0, 1))(u, jnp.asarray([[4.0, 6.0]]))
    assert np.isfinite(gu).all() and np.isfinite(gb).all()
    assert np.abs(gu).max() > 0 and np.abs(gb).min() > 0
    # all-ones weights are plain causal attention
    ones = jnp.tril(jnp.ones((24, 24)))[None, None].repeat(2, 1)
    dense, _ = kvjax.models.attention.dense_attention(q, k, v, jnp.arange(24)[None], jnp.arange(24)[None])
    np.testing.assert_allclose(np.asarray(soft_masked_attention(q, k, v, ones)), np.asarray(dense), atol=1e-5)
