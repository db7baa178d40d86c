"""Prefill compression (kvpress's setting) on the one mechanism: the kept set, the
full-budget identity with dense decoding, and parity with ``transformers`` under a 4-D mask."""

import numpy as np
import pytest
import torch

import kvjax
from kvjax.eviction.prompt_compressed import keep_context, prompt_compressed


def reference_keep(prio_S, n, keep, sinks, window):
    """Brute force for one row and head: sinks, the context's last window, then the best
    others (ties to the later token), as a set of positions."""
    prot = {t for t in range(n) if t < sinks or t >= n - window}
    others = sorted((t for t in range(n) if t not in prot), key=lambda t: (-prio_S[t], -t))
    return prot | set(others[:max(keep - sinks - window, 0)])


def test_keep_context_is_sinks_window_and_the_best_others():
    rs = np.random.RandomState(0)
    B, K, S = 3, 2, 40
    prio = rs.randint(0, 6, (B, K, S)).astype(np.float32)      # many ties
    prio[0, 1, 10] = -np.inf
    context = np.array([40, 23, 17], np.int32)
    keep = np.array([20, 12, 9], np.int32)
    got = np.asarray(keep_context(prio, context, keep, sinks=2, window=3))
    for b in range(B):
        for k in range(K):
            want = reference_keep(prio[b, k], context[b], keep[b], 2, 3)
            assert set(np.flatnonzero(got[b, k])) == want, (b, k)
            assert got[b, k].sum() == keep[b]


@pytest.fixture(scope="module")
def mqa(tmp_path_factory):
    from hf_models import make_hf_model

    ref = make_hf_model("qwen3-mqa-tied", init_std=0.25)
    folder = tmp_path_factory.mktemp("pc")
    ref.save_pretrained(folder)
    return kvjax.load_hf(folder), ref


def test_ratio_zero_generates_the_dense_tokens(mqa):
    model, _ = mqa
    rs = np.random.RandomState(1)
    rows = [rs.randint(3, 97, n).tolist() for n in (30, 22)]
    dense = np.asarray(kvjax.generate(model, rows, 12, eos_token_id=[]))
    for name in ("snapkv", "knorm", "streaming_llm", "h2o", "tova"):
        pol = prompt_compressed(kvjax.make_policy(name, kvjax.EvictionConfig(2, 4, 4)), 0.0, [25, 18])
        np.testing.assert_array_equal(np.asarray(kvjax.generate(model, rows, 12, policy=pol, eos_token_id=[])),
                                      dense, err_msg=name)


def test_question_and_answer_see_only_the_kept_context_like_transformers_with_a_mask(mqa):
    """Oracle ranking (one priority table for every layer, so one kept set): kvjax's greedy
    tokens equal the argmax of ``transformers`` teacher-forced under the 4-D mask
    'context queries see everything before them, later queries see the kept context + all after it'."""
    model, ref = mqa
    rs = np.random.RandomState(2)
    n_ctx, n_q, new = 48, 6, 10
    prompt = rs.randint(3, 97, n_ctx + n_q)
    ev = kvjax.EvictionConfig(sinks=2, window=4, topk=1)
    table = rs.randn(1, 1, 1, 128).astype(np.float32)
    oracle = kvjax.make_policy("oracle", ev, params=np.repeat(table, model.config.num_layers, 0))
    pol = prompt_compressed(oracle, 0.75, [n_ctx])
    out = np.asarray(kvjax.generate(model, prompt[None], new, policy=pol, eos_token_id=[]))[0]
    dense = np.asarray(kvjax.generate(model, prompt[None], new, eos_token_id=[]))[0]
    assert (out != dense).any()                                     # the compression changed something
    kept = np.asarray(keep_context(table[0], np.array([n_ctx]), np.array([12]), sinks=2, window=4))[0, 0]
    T = len(out) - 1
    q, t = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (t <= q) & ((q < n_ctx) | (t >= n_ctx) | np.pad(kept[:n_ctx], (0, T - n_ctx))[None, :])
    mask = torch.tensor(np.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None], dtype=torch.float32)
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        logits = ref(torch.tensor(out[None, :-1]), attention_mask=mask).logits[0].numpy()
    np.testing.assert_array_equal(logits[n_ctx + n_q - 1:].argmax(-1), out[n_ctx + n_q:])


def test_a_ratio_that_leaves_less_than_sinks_and_window_is_refused():
    pol = kvjax.make_policy("snapkv", kvjax.EvictionConfig(4, 32, 8))
    with pytest.raises(ValueError, match="keeps fewer tokens than sinks \\+ window = 36"):
        prompt_compressed(pol, 0.9, [200])
    with pytest.raises(ValueError, match="ratio must be in"):
        prompt_compressed(pol, 1.0, [200])


def test_keep_context_per_head_budgets():
    """``keep [B, K]``: each head keeps its own count, by the same rule."""
    rs = np.random.RandomState(3)
    B, K, S = 2, 3, 48
    prio = rs.randn(B, K, S).astype(np.float32)
    context = np.array([48, 30], np.int32)
    keep = np.array([[8, 20, 30], [7, 12, 15]], np.int32)
    got = np.asarray(keep_context(prio, context, keep, sinks=2, window=4))
    for b in range(B):
        for k in range(K):
            assert set(np.flatnonzero(got[b, k])) == reference_keep(prio[b, k], context[b], keep[b, k], 2, 4), (b, k)


def test_learned_head_budgets_split_the_same_total():
    """LKV-H budgets ``b`` at ``topk``: head h keeps sinks + window + floor(b_h (c - s - w) / topk);
    uniform budgets keep exactly ``c = round((1 - ratio) n)``."""
    import jax.numpy as jnp

    ev = kvjax.EvictionConfig(4, 8, 20)
    pc = prompt_compressed(kvjax.make_policy("knorm", ev), 0.75, [200, 120])
    c = np.round(0.25 * np.array([200, 120])).astype(int)                       # 50, 30
    uniform = np.asarray(pc.head_keep(jnp.full((2, 3), 20, jnp.int32), jnp.asarray([200, 120])))
    np.testing.assert_array_equal(uniform, np.repeat(c[:, None], 3, 1))
    budgets = jnp.asarray([[40, 20, 0], [40, 20, 0]], jnp.int32)                  # sums to 3 x topk
    got = np.asarray(pc.head_keep(budgets, jnp.asarray([200, 120])))
    want = 12 + (np.array([40, 20, 0])[None] * (c[:, None] - 12)) // 20
    np.testing.assert_array_equal(got, want)
    assert (got.sum(1) <= 3 * c).all()


def test_one_shared_prefill_answers_like_the_one_pass_prefill(mqa):
    """``shared_prefill``: the dense context pass once, then per policy the compression, the
    question as one chunk and greedy decoding give exactly ``generate``'s tokens, for every
    ranker kind, with contexts and questions of different lengths per row and two ratios."""
    from kvjax.eviction.shared_prefill import answer, compress, prefill_context
    from kvjax.sampling import bucket

    model, _ = mqa
    rs = np.random.RandomState(4)
    # no token twice in a row's context: K-norm ties a repeated token with itself (RoPE keeps
    # the norm), and rounding breaks such ties differently in the two computations
    ctx = [rs.permutation(np.arange(3, 97))[:n].tolist() for n in (60, 41, 52)]
    qs = [rs.randint(3, 97, n).tolist() for n in (5, 9, 1)]
    n = [len(c) for c in ctx]
    new = 7
    pre = prefill_context(model, ctx, cache_len=bucket(70) + bucket(new), keep_queries=True)
    ev = kvjax.EvictionConfig(2, 4, 8)
    for name in ("knorm", "streaming_llm", "snapkv", "h2o", "tova", "random"):
        for ratio in (0.5, 0.75):
            pol = prompt_compressed(kvjax.make_policy(name, ev), ratio, n)
            want = np.asarray(kvjax.generate(model, [c + q for c, q in zip(ctx, qs)], new, policy=pol,
                                             eos_token_id=[]))[:, -new:]
            got = answer(model, compress(pol, model, pre), qs, n, new, eos_ids=[])
            np.testing.assert_array_equal(got, want, err_msg=f"{name} at {ratio}")
    with pytest.raises(ValueError, match="other context lengths"):
        compress(prompt_compressed(kvjax.make_policy("knorm", ev), 0.5, [60, 41, 50]), model, pre)
    with pytest.raises(ValueError, match="keep_queries=True"):
        compress(prompt_compressed(kvjax.make_policy("snapkv", ev), 0.5, n), model,
                 prefill_context(model, ctx, cache_len=128, keep_queries=False))


def test_a_floor_pads_later_batches_to_the_shapes_compiled_first_with_the_same_tokens(mqa):
    """``floor``: a batch with shorter contexts, questions and kept sets than an earlier one is
    padded to the earlier sizes (they never shrink), gives the tokens it gives unpadded, and
    compiles no new answering program."""
    from kvjax.eviction import shared_prefill
    from kvjax.eviction.shared_prefill import answer, compress, prefill_context

    model, _ = mqa
    rs = np.random.RandomState(6)
    ev = kvjax.EvictionConfig(2, 4, 8)
    floors = {}

    def run(lengths, q_lengths, floored):
        ctx = [rs.permutation(np.arange(3, 97))[:n].tolist() for n in lengths]
        qs = [rs.randint(3, 97, n).tolist() for n in q_lengths]
        pre = prefill_context(model, ctx, cache_len=160 if lengths[0] > 50 else 96, keep_queries=False,
                              floor=floors.setdefault("prefill", {}) if floored else None)
        pol = prompt_compressed(kvjax.make_policy("knorm", ev), 0.5, lengths)
        return answer(model, compress(pol, model, pre), qs, lengths, 6, eos_ids=[],
                      floor=floors.setdefault("knorm", {}) if floored else None), (ctx, qs)

    run([80, 75], [40, 3], True)
    assert floors == {"prefill": {"context": 80, "cache": 160}, "knorm": {"question": 40, "slots": 40}}
    compiled = shared_prefill._answer._cache_size()
    state = rs.get_state()
    short, _ = run([30, 21], [4, 2], True)       # unpadded: 32 context slots, 32 for 15 kept, 32 question, 96 in all
    assert shared_prefill._answer._cache_size() == compiled
    assert floors == {"prefill": {"context": 80, "cache": 160}, "knorm": {"question": 40, "slots": 40}}
    rs.set_state(state)
    plain, _ = run([30, 21], [4, 2], False)
    np.testing.assert_array_equal(short, plain)


def test_compact_drops_the_evicted_entries_in_position_order(mqa):
    """``compact``: slot ``j < M`` of row b / head k holds the j-th kept context token (its key
    and value), the mask shows exactly the kept count and every slot from ``M`` on, a token
    at position ``p >= n_b`` goes to slot ``p - shift_b``; too few slots are refused."""
    from kvjax.cache.compressed import compact, kept_context
    from kvjax.eviction.shared_prefill import answer, compress, prefill_context

    model, _ = mqa
    rs = np.random.RandomState(5)
    ctx = [rs.permutation(np.arange(3, 97))[:n].tolist() for n in (60, 41)]
    n = np.array([len(c) for c in ctx])
    pre = prefill_context(model, ctx, cache_len=96, keep_queries=False)
    full = compress(prompt_compressed(kvjax.make_policy("knorm", kvjax.EvictionConfig(2, 4, 8)), 0.75, n), model,
                    pre)
    M = kept_context(full, n)
    assert M == round(0.25 * 60)                              # uniform budget: the longest row keeps the most
    small = compact(full, n, extra=8, slots=M + 3)
    np.testing.assert_array_equal(np.asarray(small.shift), n - (M + 3))
    for layer in (0, len(full.keep) - 1):
        keep = np.asarray(full.keep[layer])
        for b in range(2):
            for k in range(keep.shape[1]):
                kept = np.flatnonzero(keep[b, k, : n[b]])                     # positions, ascending
                np.testing.assert_array_equal(np.asarray(small.dense.k[layer][b, k, : len(kept)]),
                                              np.asarray(full.dense.k[layer][b, k, kept]))
                np.testing.assert_array_equal(np.asarray(small.dense.v[layer][b, k, : len(kept)]),
                                              np.asarray(full.dense.v[layer][b, k, kept]))
                vis = np.asarray(small.visible[layer][b, k])
                assert set(np.flatnonzero(vis)) == set(range(len(kept))) | set(range(M + 3, M + 3 + 8))
    with pytest.raises(ValueError, match=f"slots={M - 1} cannot hold a head's {M} kept"):
        compact(full, n, extra=8, slots=M - 1)
    with pytest.raises(ValueError, match="slots past the context"):
        answer(model, compact(full, n, extra=8), [[5, 6], [7]], n, 32, eos_ids=[])


def test_an_attention_statistic_is_computed_once_per_prefill_and_keeps_the_same_sets(mqa):
    """``compress(memo=...)``: SnapKV, PyramidKV and Ada-KV at two ratios share one statistic,
    H2O and TOVA one each; every kept set equals the one computed afresh, and another
    observation window is another statistic."""
    import dataclasses

    from kvjax.eviction.shared_prefill import compress, prefill_context

    model, _ = mqa
    rs = np.random.RandomState(5)
    ctx = [rs.randint(3, 97, n).tolist() for n in (48, 33)]
    n = [len(c) for c in ctx]
    pre = prefill_context(model, ctx, cache_len=64, keep_queries=True)
    ev = kvjax.EvictionConfig(2, 4, 8, obs_window=6)
    memo: dict = {}
    for name in ("snapkv", "pyramidkv", "adakv", "h2o", "tova"):
        for ratio in (0.5, 0.75):
            pol = prompt_compressed(kvjax.make_policy(name, ev), ratio, n)
            fresh, shared = compress(pol, model, pre), compress(pol, model, pre, memo=memo)
            for layer, (a, b) in enumerate(zip(fresh.keep, shared.keep)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {ratio} layer {layer}")
    assert len(memo) == 3
    other = prompt_compressed(kvjax.make_policy("snapkv", dataclasses.replace(ev, obs_window=3)), 0.5, n)
    compress(other, model, pre, memo=memo)
    assert len(memo) == 4
    knorm = prompt_compressed(kvjax.make_policy("knorm", ev), 0.5, n)
    compress(knorm, model, pre, memo=memo)
    assert len(memo) == 4                       # static rankers are not memoised
