"""KVpop policies with real scorers: the training mask and the decode cache agree."""

import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.forced import sparse_logits, stepwise_logits
from kvjax.eviction.learned import from_scorer
from kvjax.scorers import MLPScorer, MLSTMScorer


@pytest.fixture(scope="module")
def tiny(hf_dir):
    return kvjax.load_hf(hf_dir("llama-gqa")[0])


@pytest.mark.parametrize("ev, kind", [
    (EvictionConfig(2, 8, 6), "mlstm"), (EvictionConfig(0, 3, 12), "mlp"),     # test-fast: each kind, each config
    pytest.param(EvictionConfig(2, 8, 6), "mlp", marks=pytest.mark.integration),
    pytest.param(EvictionConfig(0, 3, 12), "mlstm", marks=pytest.mark.integration),
], ids=["sinks-mlstm", "nosinks-mlp", "sinks-mlp", "nosinks-mlstm"])
def test_training_mask_equals_decode_cache(tiny, kind, ev):
    cfg = tiny.config
    sc = (MLPScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, rngs=nnx.Rngs(1)) if kind == "mlp" else
          MLSTMScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, rngs=nnx.Rngs(1)))
    pol = from_scorer(sc, ev)
    tokens = np.random.RandomState(2).randint(3, 97, (2, 100))
    a = np.asarray(sparse_logits(tiny, tokens, pol))
    b = np.asarray(stepwise_logits(tiny, tokens, pol))
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert np.abs(a - np.asarray(kvjax.forward(tiny, tokens))).max() > 1e-2


def test_learned_policy_without_weights_is_refused(tiny):
    with pytest.raises(ValueError, match="needs trained scorer weights"):
        kvjax.generate(tiny, [[3, 4, 5]], 4, policy="kvpop_mlp")
