"""The bounded cache: train = decode (exact sets and logits), full budget = dense,
flat memory, and config errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.eviction.keep_rule import keep_mask_heads
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.forced import sparse_logits, stepwise_logits
from kvjax.eviction.policies import REGISTRY, make_policy
from kvjax.eviction.bounded import SlotScores
from kvjax.cache.slots import exiting_slot, init_buffer, place, write


def brute_keep_row(prio, q, s, w, k):
    """Keep set at query q straight from the definition (sort E(q))."""
    kept = {t for t in range(q + 1) if t < s or t > q - w}
    elig = [t for t in range(s, q - w + 1)]
    elig.sort(key=lambda t: (-prio[t], -t))
    return kept | set(elig[:k])


@functools.partial(jax.jit, static_argnums=(1,))
def decode_positions(prio_KS, ev):
    """Slot positions after each append, for a single row: ``[S, K, s + w + m]``."""
    K, S = prio_KS.shape
    buf = init_buffer(ev, 1, K, 2, jnp.float32)
    kv = jnp.zeros((1, K, 2))

    def step(buf, q):
        q_B = jnp.full((1,), q)
        slot, present = exiting_slot(buf, q_B, ev)
        p = prio_KS[:, jnp.clip(q - ev.window, 0, S - 1)][None]
        buf, target = place(buf, q_B, slot, present, p, ev)
        buf = write(buf, target, kv, kv, q_B)
        return buf, buf.pos[0]

    _, pos = jax.lax.scan(step, buf, jnp.arange(S))
    return pos


@pytest.mark.parametrize("S, s, w, k", [(1024, 4, 64, 64), (300, 0, 1, 5), (200, 3, 7, 0),
                                        (257, 2, 16, 300), (600, 1, 3, 40), (64, 8, 4, 1)])
def test_decode_state_equals_keep_mask(S, s, w, k):
    rs = np.random.RandomState(S + s + w + k)
    prio = rs.randint(0, 12, (2, S)).astype(np.float32)        # many ties
    ev = EvictionConfig(sinks=s, window=w, topk=k)
    pos = np.asarray(decode_positions(jnp.asarray(prio), ev))
    mask = np.asarray(keep_mask_heads(jnp.asarray(prio)[None], sinks=s, window=w, topk=k))[0]
    for h in range(2):
        for q in range(S):
            got = set(pos[q, h][pos[q, h] >= 0].tolist())
            assert got == set(np.flatnonzero(mask[h, q]).tolist()), (h, q)
            if q % 97 == 0 or S <= 64:
                assert got == brute_keep_row(prio[h], q, s, w, k), (h, q)
            assert len(pos[q, h]) == s + w + k      # fixed memory per head


@pytest.fixture(scope="module")
def tiny(hf_dir):
    return kvjax.load_hf(hf_dir("qwen3-gqa")[0])


@pytest.mark.parametrize("ev", [EvictionConfig(2, 8, 6), EvictionConfig(0, 1, 3), EvictionConfig(4, 16, 0)])
def test_sparse_forward_equals_stepwise_decode(tiny, ev):
    rs = np.random.RandomState(1)
    tokens = rs.randint(3, 97, (2, 96))
    cfg = tiny.config
    prio = jnp.asarray(rs.randint(0, 6, (cfg.num_layers, 2, cfg.num_kv_heads, 96)).astype(np.float32))
    pol = make_policy("oracle", ev, params=prio)
    a = np.asarray(sparse_logits(tiny, tokens, pol))
    b = np.asarray(stepwise_logits(tiny, tokens, pol))
    dense = np.asarray(kvjax.forward(tiny, tokens))
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert np.abs(a - dense).max() > 1e-2      # the budget really evicted something


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_full_budget_equals_dense_generation(tiny, name):
    prompts = [[5, 9, 11, 40, 3, 7], [8, 8, 20, 31, 77, 2, 50, 61, 12, 13, 14]]
    dense = np.asarray(kvjax.generate(tiny, prompts, 24, eos_token_id=[]))

    def build(ev):
        if name.startswith("kvpop"):
            from flax import nnx

            from kvjax.eviction.learned import from_scorer
            from kvjax.scorers import MLPScorer, MLSTMScorer

            sc = MLPScorer(2, 2, 16, rngs=nnx.Rngs(0)) if name == "kvpop_mlp" else MLSTMScorer(2, 2, 16, 8,
                                                                                               rngs=nnx.Rngs(0))
            return from_scorer(sc, ev)
        if name.startswith("lkv"):
            import dataclasses

            from flax import nnx

            from kvjax.eviction.lkv_policies import lkv_budgets_policy, lkv_policy
            from kvjax.lkv import LKVHeads, LKVTokenScorer
            from kvjax.scorers import MLSTMScorer

            ev = dataclasses.replace(ev, k_max=2 * ev.topk)   # equal head scores: every b_lh = topk
            heads = LKVHeads(2, 2, rngs=nnx.Rngs(0))
            if name == "lkv":
                return lkv_policy(heads, LKVTokenScorer(2, 2, 16, rngs=nnx.Rngs(0)), ev)
            return lkv_budgets_policy(heads, MLSTMScorer(2, 2, 16, 8, rngs=nnx.Rngs(0)), ev)
        if name == "dms":
            rs = np.random.RandomState(0)
            return make_policy(name, ev, params={"w": jnp.asarray(rs.randn(2, 2, 32), jnp.float32),
                                                 "b": jnp.zeros((2, 2), jnp.float32)})
        if name == "duo_attention":     # cap = topk: every head retrieves (full budget); small: some stream
            import dataclasses

            gates = jnp.asarray(np.random.RandomState(0).rand(2, 2), jnp.float32)
            return make_policy(name, dataclasses.replace(ev, k_max=2 * ev.topk if ev.topk < 10 else ev.topk),
                               params={"gates": gates})
        if name in ("kvzip", "kvzip_plus"):  # a model without a tokenizer: the repeat request's ids given
            import dataclasses

            from kvjax.eviction.kvzip import RepeatPrompts

            return dataclasses.replace(make_policy(name, ev), prompts=RepeatPrompts(0, (5, 6), (7,), (8, 9)))
        if name == "pyramidkv":         # a cap just above the mean: both layers' budgets cover the sequence
            import dataclasses

            ev = dataclasses.replace(ev, k_max=ev.topk + 5)
        return make_policy(name, ev, params=jnp.zeros((2, 2, 2, 64)) if name.startswith("oracle") else None)

    pol = build(EvictionConfig(sinks=2, window=8, topk=40))
    np.testing.assert_array_equal(np.asarray(kvjax.generate(tiny, prompts, 24, policy=pol, eos_token_id=[])), dense)
    small = build(EvictionConfig(sinks=1, window=2, topk=2))
    assert (np.asarray(kvjax.generate(tiny, prompts, 24, policy=small, eos_token_id=[])) != dense).any()


def test_decode_memory_is_flat():
    ev = EvictionConfig(sinks=4, window=32, topk=32)
    pol = make_policy("knorm", ev)
    cfg = kvjax.ModelConfig("qwen3", 97, 32, 64, 1, 4, 2, 16, qk_norm=True, max_position_embeddings=1 << 15)

    @functools.partial(jax.jit, static_argnums=0)
    def run(n):
        cache = pol.init(None, cfg, 1, n, jnp.float32, jnp.ones((1,), jnp.int32))
        q = jnp.ones((1, 1, 4, 16))
        kv = jnp.ones((1, 1, 2, 16))

        def step(c, i):
            _, c = pol.backend(None, 0, q * i, kv * jnp.sin(i), kv, jnp.full((1, 1), i), c)
            return c, None

        return jax.lax.scan(step, cache, jnp.arange(n))[0]

    small, large = run(1024), run(16384)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), small) == jax.tree.map(lambda x: (x.shape, x.dtype), large)
    assert small.nbytes() == large.nbytes()
    assert int(large.layers[0].pos.max()) > 1024 > int(small.layers[0].pos.max())


def test_config_errors(tiny):
    with pytest.raises(ValueError, match="EvictionConfig.window must be >= 1"):
        EvictionConfig(sinks=4, window=0, topk=8)
    with pytest.raises(ValueError, match="EvictionConfig.sinks must be a non-negative integer"):
        EvictionConfig(sinks=-1, window=4, topk=8)
    with pytest.raises(ValueError, match=r"EvictionConfig.topk \(9\) must be <= k_max \(8\)"):
        EvictionConfig(sinks=1, window=4, topk=9, k_max=8)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=512"):
        kvjax.generate(tiny, [[1, 2]], 4, policy=make_policy("knorm", EvictionConfig(4, 500, 100)))
    with pytest.raises(ValueError, match="policy: unknown name 'lru'"):
        make_policy("lru")
    with pytest.raises(ValueError, match="oracle policy needs priorities"):
        kvjax.generate(tiny, [[1, 2, 3]], 4, policy="oracle")


def test_snapkv_reranks_when_the_observation_window_refills():
    ev = EvictionConfig(sinks=1, window=4, topk=3, obs_window=4)
    pol = make_policy("snapkv", ev)
    buf = init_buffer(ev, 1, 1, 2, jnp.float32)                  # 1 sink + 4 window + 3 long-range slots
    buf = buf.replace(prio=jnp.array([[[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0]]]))
    state = SlotScores(jnp.array([[[0.0, 0.25, 0.25, 0.25, 0.25, 0.5, 0.1, 0.9]]]))
    kept, _ = pol.refresh(buf, state, jnp.array([5]))            # (5 + 1) % 4 != 0: rankings hold
    np.testing.assert_array_equal(np.asarray(kept.prio), np.asarray(buf.prio))
    due, restarted = pol.refresh(buf, state, jnp.array([7]))     # 8 queries seen: refresh
    np.testing.assert_allclose(np.asarray(due.prio), np.asarray(state.score), rtol=1e-6)
    assert float(jnp.abs(restarted.score).sum()) == 0.0


def test_knorm_gives_a_key_one_priority_at_every_rotation():
    """RoPE keeps a key's norm: the same key at 64 positions has one K-norm priority, so among
    repeats the keep rule's tie-break (the more recent token) decides, not float rounding."""
    from kvjax.models.rope import apply_rope

    k = np.random.RandomState(0).normal(size=(1, 1, 2, 64)).astype(np.float32)     # [B, S, K, D]
    pos = np.arange(0, 4096, 64)[None]                                              # [1, 64]
    inv_freq = (1.0 / 10000 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    rot = apply_rope(jnp.broadcast_to(jnp.asarray(k), (1, 64, 2, 64)), jnp.asarray(pos), inv_freq)
    raw = np.linalg.norm(np.asarray(rot), axis=-1)                                  # [1, 64, 2]
    assert len(np.unique(raw[0, :, 0])) > 1          # the float32 norms differ in their last bits
    prio = np.asarray(make_policy("knorm", EvictionConfig(2, 4, 6)).priority(None, 0, rot, rot, jnp.asarray(pos)))
    assert prio.shape == (1, 2, 64) and (prio == prio[..., :1]).all()
