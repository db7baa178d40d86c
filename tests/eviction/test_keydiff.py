"""KeyDiff: kvpress's score (``-cos(k, mean normalised key)``), the context's kept set in prefill
compression, and the bounded cache re-ranking every slot against the slots it holds."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.eviction.keydiff import keydiff_scores
from kvjax.eviction.shared_prefill import prefill_context


def kvpress_keydiff(keys_KTD):
    """kvpress 0.5.5's ``KeyDiffPress.score`` in numpy: anchor = mean of the L2-normalised keys,
    score = minus the cosine similarity to it."""
    unit = keys_KTD / np.linalg.norm(keys_KTD, axis=-1, keepdims=True)
    anchor = unit.mean(axis=1, keepdims=True)
    return -(keys_KTD * anchor).sum(-1) / (np.linalg.norm(keys_KTD, axis=-1) * np.linalg.norm(anchor, axis=-1))


def test_the_score_is_kvpress_keydiffs_over_the_valid_entries():
    rs = np.random.RandomState(0)
    k = rs.randn(2, 3, 20, 8).astype(np.float32) + 0.5
    n = np.array([20, 13])
    valid = np.arange(20)[None, None, :] < n[:, None, None]
    got = np.asarray(keydiff_scores(jnp.asarray(k), jnp.asarray(np.broadcast_to(valid, (2, 3, 20)))))
    for b in range(2):
        for h in range(3):
            want = kvpress_keydiff(k[b, h, : n[b]][None])[0]
            np.testing.assert_allclose(got[b, h, : n[b]], want, atol=1e-5)
    pol = kvjax.make_policy("keydiff", kvjax.EvictionConfig(2, 4, 8))
    stat = np.asarray(pol.prefill_statistic(None, jnp.asarray(np.swapaxes(k, 1, 2)), jnp.asarray(n)))
    np.testing.assert_allclose(stat[1, :, :13], got[1, :, :13], atol=1e-6)


@pytest.fixture(scope="module")
def tiny():
    cfg = kvjax.ModelConfig("llama", 97, 32, 64, 2, 4, 2, 16, max_position_embeddings=512, eos_token_id=2)
    return kvjax.Decoder(cfg, rngs=nnx.Rngs(0), init_std=0.3, embed_init_std=1.0)


@pytest.mark.integration        # compiles generate several times: make test, not test-fast
def test_prefill_compression_keeps_what_the_keydiff_ranking_of_the_context_keeps(tiny):
    """The same tokens as the hindsight oracle given KeyDiff's scores of the dense context keys
    (each layer and head ranks its own context, anchor over the context only)."""
    rs = np.random.RandomState(3)
    prompts = [rs.randint(3, 90, 60).tolist(), rs.randint(3, 90, 48).tolist()]
    context = [44, 36]
    ev = kvjax.EvictionConfig(2, 4, 0)
    pre = prefill_context(tiny, [p[:n] for p, n in zip(prompts, context)], cache_len=128, keep_queries=False)
    T = max(len(p) for p in prompts)
    prio = np.zeros((tiny.config.num_layers, 2, tiny.config.num_kv_heads, T), np.float32)
    for layer, k in enumerate(pre.dense.k):                                  # [B, K, slots, D]
        for b, n in enumerate(context):
            prio[layer, b, :, :n] = kvpress_keydiff(np.asarray(k[b, :, :n]))
    for ratio in (0.5, 0.75):
        a = kvjax.generate(tiny, prompts, 8, eos_token_id=[],
                           policy=kvjax.prompt_compressed(kvjax.make_policy("keydiff", ev), ratio, context))
        b = kvjax.generate(tiny, prompts, 8, eos_token_id=[], policy=kvjax.prompt_compressed(
            kvjax.make_policy("oracle", ev, params=jnp.asarray(prio)), ratio, context))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _stepwise_layer0_positions(graphdef, policy, params, tokens_S):
    model = nnx.merge(graphdef, params)
    state = policy.init(None, model.config, 1, tokens_S.shape[0], model.dtype, jnp.ones((1,), jnp.int32))

    def step(state, i):
        _, state = model(tokens_S[i][None, None], jnp.full((1, 1), i), functools.partial(policy.backend, None), state)
        return state, (state.layers[0].pos[0], state.layers[0].k[0])

    return jax.lax.scan(step, state, jnp.arange(tokens_S.shape[0]))[1]


@pytest.mark.integration        # compiles generate several times: make test, not test-fast
def test_bounded_throughout_reranks_against_the_mean_of_the_slots_held(tiny):
    """Layer 0's keys do not depend on what is evicted, so its kept set can be simulated from the
    dense keys: before each step every held slot is scored against the mean normalised key of the
    held slots; the token leaving the window stays if its score beats the lowest long-range one."""
    s, w, k = 2, 4, 6
    tokens = jnp.asarray(np.random.RandomState(5).randint(3, 90, 48), jnp.int32)
    graphdef, params = nnx.split(tiny)
    full = kvjax.make_policy("keydiff", kvjax.EvictionConfig(s, w, 48))
    _, dense_k = _stepwise_layer0_positions(graphdef, full, params, tokens)
    keys = np.asarray(dense_k[-1])                                             # [K, slots, D], slot = position
    pos, _ = _stepwise_layer0_positions(graphdef, kvjax.make_policy("keydiff", kvjax.EvictionConfig(s, w, k)),
                                        params, tokens)
    pos = np.asarray(pos)
    for h in range(keys.shape[0]):
        held: set[int] = set()
        for q in range(len(tokens)):
            t = q - w                                                          # leaves the window as q arrives
            if t >= s:
                ids = sorted(held)
                score = dict(zip(ids, kvpress_keydiff(keys[h, ids][None])[0]))
                long_range = [x for x in held if s <= x < t]
                if len(long_range) >= k:
                    low = min(long_range, key=lambda x: (score[x], x))
                    if score[t] >= score[low]:
                        held.discard(low)
                    else:
                        held.discard(t)
            held.add(q)
            got = set(pos[q, h][pos[q, h] >= 0].tolist())
            assert got == held, (h, q)
