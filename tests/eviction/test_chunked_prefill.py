"""Chunked prefill (``EvictionConfig.prefill_chunk``) keeps exactly what one pass keeps."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.policies import make_policy


@pytest.fixture(scope="module")
def tiny(hf_dir):
    return kvjax.load_hf(hf_dir("qwen3-gqa")[0])


def _build(name, ev, cfg):
    if name == "kvpop_mlstm":
        from kvjax.eviction.learned import from_scorer
        from kvjax.scorers import MLSTMScorer

        return from_scorer(MLSTMScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, rngs=nnx.Rngs(0)), ev)
    if name == "lkv":
        from kvjax.eviction.lkv_policies import LKV
        from kvjax.lkv import LKVTokenScorer

        tdef, tparams = nnx.split(LKVTokenScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, rngs=nnx.Rngs(1)))
        budgets = jnp.asarray([[3, 9], [12, 0]], jnp.int32)                  # unequal per-head budgets, one empty
        return LKV(dataclasses.replace(ev, k_max=12), params={"budgets": budgets, "tokens": nnx.to_pure_dict(tparams)},
                   tokens_def=tdef)
    prio = None
    if name == "oracle":                                                    # many ties
        prio = jnp.asarray(np.random.RandomState(2).randint(0, 4, (cfg.num_layers, 2, cfg.num_kv_heads, 128)),
                           jnp.float32)
    return make_policy(name, ev, params=prio)


def _prefill(model, pol, tokens, lengths):
    graphdef, params = nnx.split(model)
    B, S = tokens.shape

    @jax.jit
    def run(params, pparams):
        m = nnx.merge(graphdef, params)
        cache = pol.init(pparams, m.config, B, S, m.dtype, lengths)
        h, cache = m(tokens, None, functools.partial(pol.backend, pparams), cache)
        return m.logits(h), cache

    return run(params, pol.params)


def _kept_sets(cache):
    return [[[set(np.asarray(buf.pos)[b, h][np.asarray(buf.pos)[b, h] >= 0].tolist()) for h in range(buf.pos.shape[1])]
             for b in range(buf.pos.shape[0])] for buf in cache.layers]


@pytest.mark.parametrize("name", ["knorm", "oracle", "kvpop_mlstm", "lkv", "streaming_llm"])
def test_chunked_prefill_equals_one_pass(tiny, name):
    rs = np.random.RandomState(0)
    lengths = np.array([93, 41])
    tokens = np.zeros((2, 93), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rs.randint(3, 97, n)
    ev = EvictionConfig(sinks=3, window=6, topk=8)
    one = _build(name, ev, tiny.config)
    chunked = one.with_prefill("chunked", 16)
    la, ca = _prefill(tiny, one, jnp.asarray(tokens), jnp.asarray(lengths))
    lb, cb = _prefill(tiny, chunked, jnp.asarray(tokens), jnp.asarray(lengths))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(lb)[b, :n], np.asarray(la)[b, :n], atol=2e-5, rtol=0)
    assert _kept_sets(ca) == _kept_sets(cb)
    dense = np.asarray(kvjax.forward(tiny, tokens[:1]))
    assert np.abs(np.asarray(la)[0] - dense[0]).max() > 1e-2               # the budget evicted something
    prompts = [tokens[b, :n].tolist() for b, n in enumerate(lengths)]
    np.testing.assert_array_equal(np.asarray(kvjax.generate(tiny, prompts, 10, policy=chunked, eos_token_id=[])),
                                  np.asarray(kvjax.generate(tiny, prompts, 10, policy=one, eos_token_id=[])))


def test_prefill_chunk_errors():
    with pytest.raises(ValueError, match="EvictionConfig.prefill_chunk must be a non-negative integer, got -1"):
        EvictionConfig(prefill_chunk=-1)
    with pytest.raises(ValueError, match="prefill_chunk is the chunk of prefill='chunked'"):
        EvictionConfig(prefill_chunk=16)
    with pytest.raises(ValueError, match="prefill_chunk is the chunk of prefill='chunked'"):
        EvictionConfig(prefill="chunked")
    with pytest.raises(ValueError, match="prefill='chunked' needs priorities known before the attention"):
        kvjax.make_policy("snapkv").with_prefill("chunked", 16)
