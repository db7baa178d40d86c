"""``model.remat``: the same loss and gradients, with each block recomputed in the backward pass."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax.train.config import ModelSection
from kvjax.train.model_init import build_model

CFG = {"model_type": "qwen3", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}


def _loss_and_grads(model, tokens):
    graphdef, params = nnx.split(model)

    def loss(p):
        m = nnx.merge(graphdef, p)
        h, _ = m(tokens)
        return jnp.mean(jax.nn.logsumexp(m.logits(h), axis=-1))

    return jax.value_and_grad(loss)(params), jax.make_jaxpr(loss)(params)


def test_remat_gives_the_same_gradients_and_recomputes():
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 97, (2, 24)))
    plain = build_model(ModelSection(config=CFG), seed=3)
    remat = build_model(ModelSection(config=CFG, remat=True), seed=3)
    assert (plain.remat, remat.remat) == (False, True)
    (l0, g0), jaxpr0 = _loss_and_grads(plain, tokens)
    (l1, g1), jaxpr1 = _loss_and_grads(remat, tokens)
    assert float(l0) == float(l1)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert "remat" not in str(jaxpr0) and str(jaxpr1).count("remat") >= CFG["num_hidden_layers"]   # remat2 per block


def test_remat_model_generates_like_the_plain_one():
    plain = build_model(ModelSection(config=CFG), seed=1)
    remat = build_model(ModelSection(config=CFG, remat=True), seed=1)
    prompts = [[5, 9, 11, 40], [8, 8, 20]]
    np.testing.assert_array_equal(np.asarray(kvjax.generate(plain, prompts, 6, eos_token_id=[])),
                                  np.asarray(kvjax.generate(remat, prompts, 6, eos_token_id=[])))
