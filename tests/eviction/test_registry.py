"""A user's policy: one protocol, ``@kvjax.register``, usable by name everywhere."""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.eviction.registry import REGISTRY

CFG = {"model_type": "qwen3", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}


@kvjax.register
@dataclasses.dataclass(frozen=True)
class ValueNorm(kvjax.StaticPriority):
    name: ClassVar[str] = "test_value_norm"

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        return jnp.swapaxes(jnp.linalg.norm(v_BSKD, axis=-1), 1, 2)


@pytest.fixture(scope="module", autouse=True)
def _unregister_after():
    yield
    REGISTRY.pop("test_value_norm", None)      # later modules in this worker see the built-in set


PROMPTS = [list(np.random.RandomState(0).randint(3, 97, 60))]


@pytest.fixture(scope="module")
def model():
    return kvjax.Decoder(kvjax.ModelConfig.from_hf_config(CFG), rngs=nnx.Rngs(0))


@pytest.mark.integration        # two generation compiles: make test, not the test-fast loop
def test_a_registered_policy_generates_by_name(model):
    prompts = PROMPTS
    dense = np.asarray(kvjax.generate(model, prompts, 8, eos_token_id=[]))
    full = kvjax.make_policy("test_value_norm", kvjax.EvictionConfig(2, 8, 64))
    np.testing.assert_array_equal(np.asarray(kvjax.generate(model, prompts, 8, policy=full, eos_token_id=[])), dense)


def test_a_registered_policy_keeps_what_its_priority_says(model):
    prompts = PROMPTS
    from kvjax.evaluation.retention import kept_positions

    tokens = np.asarray(prompts, np.int32)
    _, lr = kept_positions(model, tokens, np.array([60]), kvjax.make_policy("test_value_norm",
                                                                            kvjax.EvictionConfig(2, 8, 5)))
    k, v = _keys_values(model, tokens)
    for layer in range(1):            # layer 0's values do not depend on what the cache evicts
        for h in range(2):
            norms = np.linalg.norm(v[layer][0, :, h], axis=-1)
            eligible = np.arange(2, 59 - 8 + 1)                      # E(q) = {s <= t <= q - w} at q = 59
            best = eligible[np.lexsort((-eligible, -norms[eligible]))][:5]   # ties (a repeated token): the later
            assert set(lr[layer, 0, h][lr[layer, 0, h] >= 0].tolist()) == set(best.tolist())


def _keys_values(model, tokens):
    """Post-RoPE keys and values of every layer from a dense forward."""
    out = {"k": [], "v": []}

    def backend(layer, q, k, v, positions, state):
        out["k"].append(np.asarray(k))
        out["v"].append(np.asarray(v))
        from kvjax.models.decoder import causal_attention
        return causal_attention(layer, q, k, v, positions, state)

    model(jnp.asarray(tokens), None, backend, None)
    return out["k"], out["v"]


def test_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="the policy name 'knorm' is taken"):
        @kvjax.register
        @dataclasses.dataclass(frozen=True)
        class Other(kvjax.StaticPriority):
            name: ClassVar[str] = "knorm"
    assert REGISTRY["knorm"].__name__ == "KNorm"
