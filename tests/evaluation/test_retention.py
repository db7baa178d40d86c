"""Retention recall and eviction maps read the cache a policy holds when the answer starts."""

import numpy as np
from flax import nnx

import kvjax
from kvjax.eviction.keep_rule import keep_mask
from kvjax.eviction.policies import make_policy
from kvjax.evaluation.retention import eviction_map, kept_positions, retention_recall
from train_helpers import TINY_MODEL


def test_kept_positions_are_the_keep_rule_row_and_recall_counts_the_overlap():
    model = kvjax.Decoder(kvjax.ModelConfig.from_hf_config(TINY_MODEL), rngs=nnx.Rngs(0), init_std=0.2)
    cfg = model.config
    L, K, S = cfg.num_layers, cfg.num_kv_heads, 40
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, 200, (2, S))
    lengths = np.array([40, 29])
    prio = rng.randn(L, 2, K, S).astype(np.float32)
    ev = kvjax.EvictionConfig(sinks=2, window=4, topk=7)
    every, lr = kept_positions(model, tokens, lengths, make_policy("oracle", ev, params=prio))
    for l in range(L):
        for b in range(2):
            n = lengths[b]
            for k in range(K):
                want = set(np.flatnonzero(np.asarray(keep_mask(prio[l, b, k, :n], sinks=2, window=4, topk=7))[n - 1]))
                assert set(every[l, b, k][every[l, b, k] >= 0].tolist()) == want
                assert set(lr[l, b, k][lr[l, b, k] >= 0].tolist()) == want - {0, 1} - set(range(n - 4, n))
    assert np.all(retention_recall(every, lr, S) == 1.0)
    # StreamingLLM with the same budget keeps the sinks and the last 11 tokens: recall is the
    # share of the oracle's long-range picks that happen to be among the recent tokens
    stream, _ = kept_positions(model, tokens, lengths, make_policy("streaming_llm", ev))
    rec = retention_recall(stream, lr, S)
    for l in range(L):
        for b in range(2):
            n = lengths[b]
            for k in range(K):
                picks = set(lr[l, b, k][lr[l, b, k] >= 0].tolist())
                assert rec[l, b, k] == len(picks & set(range(n - 11, n))) / len(picks)
    counts = eviction_map(every, 1, S)
    assert counts.shape == (L, S) and counts[:, 0].tolist() == [K] * L and counts[:, 29:].sum() == 0
    assert counts.sum() == sum(int((every[l, 1, k] >= 0).sum()) for l in range(L) for k in range(K))
