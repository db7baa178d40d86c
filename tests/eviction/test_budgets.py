"""Budget allocation (PyramidKV, Ada-KV, fixed shares): the split's totals equal the uniform budget, the
selection equals a brute force, and both settings (bounded, prefill compression) use it."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.eviction.budgets import adakv_budgets, adakv_select, apportion, pyramid_budgets, shares_budgets
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.policies import make_policy
from kvjax.eviction.prompt_compressed import adakv_keep_context, prompt_compressed


@pytest.mark.parametrize("L, m, cap, beta", [(30, 100, 200, 20), (30, 100, 120, 20), (7, 13, 26, 4.0),
                                              (2, 40, 45, 20), (1, 9, 9, 20), (12, 0, 0, 20)])
def test_pyramid_budgets_sum_to_the_uniform_total_and_fall_with_depth(L, m, cap, beta):
    b = pyramid_budgets(L, m, cap, beta)
    assert b.sum() == L * m
    assert (np.diff(b) <= 0).all() and b.max() <= cap and b.min() >= 0
    if L > 1 and m > 0:
        high = min(2 * m - m / beta, cap)
        assert abs(b[0] - high) <= 1 and abs(b[-1] - (2 * m - high)) <= 1


def test_pyramid_budgets_match_the_papers_formula_uncapped():
    b = pyramid_budgets(30, 100, 1000, 20)          # b_0 = 195, b_29 = 5, step 190 / 29
    x = 195 - np.arange(30) * 190 / 29
    assert (np.abs(b - x) < 1).all()


def test_pyramid_and_apportion_refuse_bad_input():
    with pytest.raises(ValueError, match="cap k_max=50 is below the mean budget topk=64"):
        pyramid_budgets(4, 64, 50)
    with pytest.raises(ValueError, match="pyramid_beta must be >= 1"):
        pyramid_budgets(4, 64, 128, 0.5)
    with pytest.raises(ValueError, match="not the total"):
        apportion([1.5, 2.0], 7)
    with pytest.raises(ValueError, match="budgets must be one of 'uniform', 'pyramid', 'adakv', 'shares', 'global', 'layer'"):
        EvictionConfig(budgets="duo")
    with pytest.raises(ValueError, match="adakv_alpha must be in"):
        EvictionConfig(adakv_alpha=1.5)


def brute_adakv(prio_KN, cand_KN, n_top, alpha):
    """Ada-KV for one row, straight from its definition: each head's best floor(alpha n)
    candidates, then the best remaining over all heads up to K n (ties: later flat index)."""
    K, N = prio_KN.shape
    kept = set()
    for h in range(K):
        own = sorted((t for t in range(N) if cand_KN[h, t]), key=lambda t: (-prio_KN[h, t], -t))
        kept |= {(h, t) for t in own[:int(np.floor(alpha * n_top))]}
    rest = sorted(((h, t) for h in range(K) for t in range(N) if cand_KN[h, t] and (h, t) not in kept),
                  key=lambda ht: (-prio_KN[ht], -(ht[0] * N + ht[1])))
    return kept | set(rest[:max(K * n_top - len(kept), 0)])


@pytest.mark.parametrize("alpha", [0.0, 0.2, 1.0])
def test_adakv_select_equals_brute_force_and_keeps_the_layer_total(alpha):
    rs = np.random.RandomState(3)
    B, K, N = 3, 4, 50
    prio = (rs.randn(B, K, N) * np.array([0.1, 1.0, 3.0, 0.5])[None, :, None]).astype(np.float32)
    prio[1] = np.round(prio[1])                                       # ties
    cand = rs.rand(B, K, N) < 0.8
    n_top = np.array([6, 10, 30], np.int32)                           # row 2: fewer candidates than K n
    got = np.asarray(adakv_select(jnp.asarray(prio), jnp.asarray(cand), jnp.asarray(n_top), alpha))
    for b in range(B):
        want = brute_adakv(prio[b], cand[b], n_top[b], alpha)
        assert set(zip(*np.nonzero(got[b]))) == want, b
        assert got[b].sum() == min(K * n_top[b], cand[b].sum())
    counts = got.sum(-1)
    assert (counts[0] != counts[0, 0]).any() == (alpha < 1)           # alpha 1: the uniform split
    budgets = np.asarray(adakv_budgets(jnp.asarray(got), jnp.asarray(n_top), 100))
    np.testing.assert_array_equal(budgets.sum(-1), K * n_top)          # unused slots are shared, total kept
    assert (budgets >= counts).all()


def test_adakv_prefill_compression_keeps_the_uniform_total_per_layer():
    rs = np.random.RandomState(4)
    B, K, S = 2, 3, 60
    prio = rs.randn(B, K, S).astype(np.float32)
    context = np.array([60, 41], np.int32)
    keep = np.broadcast_to(np.array([30, 21], np.int32)[:, None], (B, K))
    got = np.asarray(adakv_keep_context(jnp.asarray(prio), jnp.asarray(context), jnp.asarray(keep), sinks=2, window=3,
                                        alpha=0.2))
    for b in range(B):
        assert got[b].sum() == K * keep[b, 0]
        assert not got[b, :, context[b]:].any()
        assert got[b, :, :2].all() and got[b, :, context[b] - 3:context[b]].all()
        n_top = keep[b, 0] - 5
        assert (got[b].sum(-1) - 5 >= int(0.2 * n_top)).all()          # the safeguard


@pytest.fixture(scope="module")
def tiny(hf_dir):
    return kvjax.load_hf(hf_dir("qwen3-gqa")[0])


def test_pyramid_head_budgets_total_the_uniform_budget(tiny):
    cfg = tiny.config
    pol = make_policy("pyramidkv", EvictionConfig(sinks=2, window=4, topk=10))
    b = np.asarray(pol.head_budgets(None, cfg, 3))
    assert b.shape == (cfg.num_layers, 3, cfg.num_kv_heads)
    assert b.sum() == cfg.num_layers * 3 * cfg.num_kv_heads * 10
    assert b[0, 0, 0] > b[-1, 0, 0]
    assert pol.effective().k_max == 20


def test_adakv_bounded_reallocates_at_the_layer_total(tiny):
    """Bounded throughout (token by token through the decode path), every SnapKV refresh re-splits
    the layer's slots: the budgets differ across heads, total K topk, and no head holds more."""
    import functools

    import jax
    from flax import nnx

    ev = EvictionConfig(sinks=2, window=4, topk=6, obs_window=8)
    pol = make_policy("adakv", ev)
    B, S = 2, 72                                 # 72 steps: the last one is a refresh (q + 1 = 72)
    rows = jnp.asarray(np.random.RandomState(5).randint(3, 97, (B, S)))
    graphdef, params = nnx.split(tiny)

    @jax.jit
    def run(params):
        model = nnx.merge(graphdef, params)
        cache = pol.init(None, model.config, B, S, jnp.float32, jnp.ones((B,), jnp.int32))

        def step(cache, i):
            _, cache = model(jax.lax.dynamic_slice_in_dim(rows, i, 1, axis=1), jnp.full((B, 1), i), functools.partial(pol.backend, None), cache)
            return cache, None

        return jax.lax.scan(step, cache, jnp.arange(S))[0]

    cache = run(params)
    K = tiny.config.num_kv_heads
    uneven = False
    for buf in cache.layers:
        budget, pos = np.asarray(buf.budget), np.asarray(buf.pos)
        np.testing.assert_array_equal(budget.sum(-1), K * 6)
        held = ((pos >= 2) & (pos <= S - 1 - 4)).sum(-1)
        assert (held <= budget).all() and (budget <= ev.topk * 2).all()
        uneven |= bool((budget != 6).any())
    assert uneven                                # some head gave slots to another


@pytest.mark.integration        # three generation compiles: make test, not the test-fast loop
def test_budget_rules_compose_with_rankers_under_prompt_compression(tiny):
    rows = [np.random.RandomState(6).randint(3, 97, 40).tolist()]
    dense = np.asarray(kvjax.generate(tiny, rows, 8, eos_token_id=[]))
    knorm_ada = make_policy("knorm", EvictionConfig(sinks=2, window=4, topk=60, budgets="adakv"))
    pol = prompt_compressed(knorm_ada, 0.0, [36])                    # ratio 0: everything kept
    np.testing.assert_array_equal(np.asarray(kvjax.generate(tiny, rows, 8, policy=pol, eos_token_id=[])), dense)
    small = prompt_compressed(knorm_ada, 0.75, [36])
    assert (np.asarray(kvjax.generate(tiny, rows, 8, policy=small, eos_token_id=[])) != dense).any()


def test_budget_rules_refuse_what_they_cannot_do(tiny):
    rows = [np.random.RandomState(6).randint(3, 97, 40).tolist()]
    knorm_ada = make_policy("knorm", EvictionConfig(sinks=2, window=4, topk=60, budgets="adakv"))
    with pytest.raises(ValueError, match="Ada-KV budgets follow attention scores"):
        kvjax.generate(tiny, rows, 8, policy=knorm_ada, eos_token_id=[])
    snap_pyramid = make_policy("snapkv", EvictionConfig(sinks=2, window=4, topk=6, k_max=12, budgets="pyramid"))
    assert dataclasses.replace(make_policy("pyramidkv", snap_pyramid.config)).effective() == snap_pyramid.effective()


def test_shares_split_fixed_budgets_and_refuse_bad_tables(tiny):
    """``budgets="shares"``: head (l, k) fills floor(share * topk) slots, capped at k_max; the kept
    sets follow (a head with share 0 keeps only sinks + window)."""
    cfg = tiny.config
    L, K = cfg.num_layers, cfg.num_kv_heads
    shares = tuple(tuple(float(l * K + k) / (L * K - 1) * 2 for k in range(K)) for l in range(L))   # mean 1
    ev = EvictionConfig(sinks=2, window=4, topk=10, k_max=20, budgets="shares", head_shares=shares)
    b = np.asarray(make_policy("knorm", ev).head_budgets(None, cfg, 2))
    np.testing.assert_array_equal(b[:, 1], np.minimum(np.floor(np.asarray(shares) * 10 + 1e-9), 20))
    assert b[0, 0, 0] == 0 and b.max() == 20
    assert shares_budgets([[100.0] * K] * L, 10, 20, (L, K)).max() == 20
    from kvjax.evaluation.retention import kept_positions

    tokens = np.random.RandomState(0).randint(3, 97, (1, 40))
    _, long_range = kept_positions(tiny, tokens, np.asarray([40]), make_policy("knorm", ev))   # [L, B, K, N]
    np.testing.assert_array_equal((long_range[:, 0] >= 0).sum(-1), b[:, 0])     # 34 candidates >= every budget
    for bad, msg in [(dict(budgets="shares"), "give it exactly when budgets='shares'"),
                     (dict(head_shares=((1.0,),)), "give it exactly when budgets='shares'"),
                     (dict(budgets="shares", head_shares=((1.0, 2.0), (1.0,))), "rectangular"),
                     (dict(budgets="shares", head_shares=((-1.0,),)), "finite shares >= 0"),
                     (dict(budgets="shares", head_shares="ab"), "table of numbers")]:
        with pytest.raises(ValueError, match=msg):
            EvictionConfig(sinks=2, window=4, topk=10, **bad)
    with pytest.raises(ValueError, match=r"head_shares has shape \(1, 1\)"):
        make_policy("knorm", dataclasses.replace(ev, head_shares=((1.0,),))).head_budgets(None, cfg, 1)
