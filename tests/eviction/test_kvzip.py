"""KVzip: the reconstruction scores against a brute-force replay (the context and the repeat
request as one causal sequence), one top-k across layers and heads, and the policy in
``generate`` under prefill compression."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.eviction.kvzip import RepeatPrompts, reconstruction_scores
from kvjax.eviction.prompt_compressed import shared_keep_context
from kvjax.eviction.shared_prefill import prefill_context

PROMPTS = RepeatPrompts(head=3, first=(7, 8, 9), later=(10, 11), suffix=(12, 13), sinks=2, chunk=16, postfix=3)


@pytest.fixture(scope="module")
def tiny():
    cfg = kvjax.ModelConfig("llama", 97, 32, 64, 2, 4, 2, 16, max_position_embeddings=512, eos_token_id=2)
    return kvjax.Decoder(cfg, rngs=nnx.Rngs(0), init_std=0.3, embed_init_std=1.0)


def layer_inputs(model, tokens):
    """``[L, S, E]``: each layer's normalised input over one causal pass (recorded by a backend)."""
    from kvjax.models.decoder import causal_attention

    seen = {}

    def record(layer, q, k, v, positions, state, hidden_BSE):
        seen[layer] = np.asarray(hidden_BSE[0], np.float64)
        return causal_attention(layer, q, k, v, positions, state)

    record.takes_hidden = True
    model(jnp.asarray([tokens]), None, record, None)
    return np.stack([seen[i] for i in range(len(seen))])


def brute_scores(model, ctx, p: RepeatPrompts, plus: bool = False):
    """``[L, K, n]`` from each chunk's replay written out: a dense pass over context + request,
    each request query's softmax over the sinks, the chunk and the request so far, max over the
    group's query heads and the request's queries. ``plus``: each weight times the value's
    ``||W_O[g] v||`` over the query's ``||h||`` (KVzip+)."""
    cfg = model.config
    L, K, G, D = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    n = len(ctx)
    body = ctx[p.head:]
    chunks = [body[i:i + p.chunk] for i in range(0, len(body), p.chunk)]
    out = np.zeros((L, K, n))
    for c, ids in enumerate(chunks):
        ask = list(p.first if c == 0 else p.later + tuple(chunks[c - 1][-p.postfix:]))
        rep = ask + list(p.suffix) + ids
        lo, hi, R = p.head + c * p.chunk, p.head + c * p.chunk + len(ids), len(rep)
        pre = prefill_context(model, [ctx + rep], cache_len=256, keep_queries=True)
        hidden = layer_inputs(model, ctx + rep) if plus else None
        for layer in range(L):
            q = np.asarray(pre.queries[layer, 0, n:n + R])                      # [R, H, D]
            k = np.asarray(pre.dense.k[layer][0, :, :n + R])                    # [K, n + R, D]
            v = np.asarray(pre.dense.v[layer][0, :, :n + R], np.float64)
            wo = np.asarray(model.layers[layer].self_attn.o_proj[...], np.float64)    # [H, D, E]
            cols = list(range(min(p.sinks, lo))) + list(range(lo, hi)) + list(range(n, n + R))
            for h in range(K):
                for g in range(G):
                    for i in range(R):
                        keys = cols[: len(cols) - R + i + 1]                      # the request causally
                        logits = k[h, keys] @ q[i, h * G + g] / np.sqrt(D)
                        w = np.exp(logits - logits.max())
                        w /= w.sum()
                        chunk_w = w[min(p.sinks, lo): min(p.sinks, lo) + hi - lo]
                        if plus:
                            value_out = np.linalg.norm(v[h, lo:hi] @ wo[h * G + g], axis=-1)
                            chunk_w = chunk_w * value_out / np.linalg.norm(hidden[layer, n + i])
                        out[layer, h, lo:hi] = np.maximum(out[layer, h, lo:hi], chunk_w)
    return out


def test_reconstruction_scores_equal_a_brute_force_replay_over_chunks(tiny):
    rs = np.random.RandomState(0)
    contexts = [rs.randint(14, 90, 40).tolist(), rs.randint(14, 90, 27).tolist()]   # 3 and 2 chunks of 16
    pre = prefill_context(tiny, contexts, cache_len=64, keep_queries=False)
    got = np.asarray(reconstruction_scores(tiny, pre.dense.k, pre.dense.v, contexts, PROMPTS, block=8))
    top = got.max()
    for b, ctx in enumerate(contexts):
        want = brute_scores(tiny, ctx, PROMPTS)
        n = len(ctx)
        np.testing.assert_allclose(got[:, b, :, 2:n], want[:, :, 2:], atol=2e-5)
        assert np.all(got[:, b, :, :2] == top)                                # the sinks score highest
        assert np.all(got[:, b, :, n:] == 0) and np.all(got[:, b, :, 2:3] == 0)   # past the context; the head
    assert top > 1.0


def test_kvzip_plus_scores_equal_a_brute_force_replay(tiny):
    rs = np.random.RandomState(3)
    contexts = [rs.randint(14, 90, 35).tolist(), rs.randint(14, 90, 22).tolist()]
    pre = prefill_context(tiny, contexts, cache_len=64, keep_queries=False)
    got = np.asarray(reconstruction_scores(tiny, pre.dense.k, pre.dense.v, contexts, PROMPTS, block=8, plus=True))
    plain = np.asarray(reconstruction_scores(tiny, pre.dense.k, pre.dense.v, contexts, PROMPTS, block=8))
    for b, ctx in enumerate(contexts):
        n = len(ctx)
        np.testing.assert_allclose(got[:, b, :, 3:n], brute_scores(tiny, ctx, PROMPTS, plus=True)[:, :, 3:],
                                   rtol=2e-4, atol=1e-6)
    assert not np.allclose(got[:, 0, :, 3:35], plain[:, 0, :, 3:35])            # the weighting changes scores
    assert kvjax.make_policy("kvzip_plus").plus and not kvjax.make_policy("kvzip").plus


def test_one_top_k_over_all_layers_and_heads():
    rs = np.random.RandomState(1)
    L, B, K, S = 3, 2, 2, 30
    prio = rs.randn(L, B, K, S).astype(np.float32)
    context = np.array([30, 22])
    keep = np.array([12, 9])
    s, w = 2, 3
    for scope in ("global", "layer"):
        kept = np.asarray(shared_keep_context(jnp.asarray(prio), jnp.asarray(context), jnp.asarray(keep), sinks=s,
                                              window=w, scope=scope))
        for b in range(B):
            n = context[b]
            prot = np.zeros(S, bool)
            prot[:s] = True
            prot[n - w:n] = True
            assert kept[:, b][:, :, prot].all() and not kept[:, b][:, :, n:].any()
            elig = np.zeros(S, bool)
            elig[s:n - w] = True
            groups = [np.s_[:]] if scope == "global" else [np.s_[i] for i in range(L)]
            for grp in groups:
                scores = prio[grp, b][..., elig].ravel()
                chosen = kept[grp, b][..., elig].ravel()
                n_top = (L if scope == "global" else 1) * K * (keep[b] - s - w)
                assert chosen.sum() == n_top
                assert set(np.flatnonzero(chosen)) == set(np.argsort(-scores, kind="stable")[:n_top])


@pytest.mark.integration        # compiles generate several times: make test, not test-fast
def test_kvzip_in_generate_is_the_oracle_of_its_scores_under_a_global_budget(tiny):
    rs = np.random.RandomState(2)
    prompts = [rs.randint(14, 90, 50).tolist(), rs.randint(14, 90, 44).tolist()]
    context = [40, 36]
    ev = kvjax.EvictionConfig(2, 3, 0)
    kvzip = kvjax.make_policy("kvzip", ev)
    kvzip = dataclasses.replace(kvzip, prompts=PROMPTS)
    pre = prefill_context(tiny, [p[:n] for p, n in zip(prompts, context)], cache_len=64, keep_queries=False)
    scores = reconstruction_scores(tiny, pre.dense.k, pre.dense.v, [p[:n] for p, n in zip(prompts, context)], PROMPTS)
    oracle = kvjax.make_policy("oracle", dataclasses.replace(ev, budgets="global"), params=scores)
    for ratio in (0.5, 0.8):
        a = kvjax.generate(tiny, prompts, 6, eos_token_id=[], policy=kvjax.prompt_compressed(kvzip, ratio, context))
        b = kvjax.generate(tiny, prompts, 6, eos_token_id=[], policy=kvjax.prompt_compressed(oracle, ratio, context))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    layerwise = kvjax.prompt_compressed(dataclasses.replace(kvzip, config=dataclasses.replace(ev, budgets="layer")),
                                        0.8, context)
    assert kvjax.generate(tiny, prompts, 6, eos_token_id=[], policy=layerwise).shape == (2, 56)
    # bounded throughout: the whole prompt scored, L K topk long-range slots split by one top-k
    bounded = dataclasses.replace(kvzip, config=kvjax.EvictionConfig(2, 3, 6))
    ready = bounded.prepare(tiny, np.asarray([p + [0] * (50 - len(p)) for p in prompts]), np.array([50, 44]))
    b = np.asarray(ready.params["budgets"])                                        # [L, B, K]
    assert b.shape == (2, 2, 2) and (b.sum(axis=(0, 2)) == 2 * 2 * 6).all()
    assert ready.config.k_max == b.max() and b.min() < 6 < b.max()                 # shares differ by head
    assert kvjax.generate(tiny, prompts, 6, eos_token_id=[], policy=bounded).shape == (2, 56)
    with pytest.raises(ValueError, match="the model's tokenizer"):
        kvjax.generate(tiny, prompts, 2, policy=kvjax.prompt_compressed(kvjax.make_policy("kvzip", ev), 0.5, context))
    # K-norm under the same global budget: tests/eviction/test_shared_budgets.py
