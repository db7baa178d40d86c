"""distill_kvpop: retention gradients reach only the scorers, distillation only the backbone;
a short run on the testbed lowers its losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.losses import boundary_pairwise_loss, kl_distill, regression_loss
from kvjax.train.config import EvictionSection, KVpopSection, TrainConfig
from kvjax.train.distill_kvpop import Student, sparse_student_forward, student_scorers
from kvjax.train.optim import split_params


def _nonzero(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in p): bool(jnp.any(x != 0))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_gradient_separation(hf_dir, scorer):
    model = kvjax.load_hf(hf_dir("qwen3-gqa")[0])
    cfg = TrainConfig(steps=1, eviction=EvictionSection(sinks=2, window=6, topk=10, kvpop=KVpopSection(scorer=scorer)))
    student = Student(model, student_scorers(cfg, model.config, 0))
    graphdef, params = split_params(student)
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 97, (2, 64)))
    teacher_logits = kvjax.forward(model, tokens) + 0.5 * jax.random.normal(jax.random.key(0), (2, 64, 97))
    ev = cfg.eviction

    def parts(p):
        logits, per_layer = sparse_student_forward(nnx.merge(graphdef, p), tokens, cfg)
        ret = sum(regression_loss(r, t, centred=ev.kvpop.regression_centred)
                  + boundary_pairwise_loss(ph, t, sinks=ev.sinks, window=ev.window, topk=ev.topk)
                  for r, ph, t in per_layer)
        return ret, kl_distill(teacher_logits, logits, jnp.ones((2, 64)))

    g_ret = jax.grad(lambda p: parts(p)[0])(params)
    g_kd = jax.grad(lambda p: parts(p)[1])(params)
    ret_nz, kd_nz = _nonzero(g_ret), _nonzero(g_kd)
    assert not any(v for k, v in ret_nz.items() if k.startswith("backbone"))
    assert any(v for k, v in ret_nz.items() if k.startswith("scorers"))
    assert not any(v for k, v in kd_nz.items() if k.startswith("scorers"))
    assert any(v for k, v in kd_nz.items() if k.startswith("backbone"))


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_the_trained_attention_is_the_decoded_one(hf_dir, scorer):
    """The student's training forward runs through its policy's methods: its logits are the
    policy's teacher-forced sparse logits and its token-by-token decode logits."""
    from kvjax.eviction.forced import sparse_logits, stepwise_logits
    from kvjax.train.distill_kvpop import student_policy

    model = kvjax.load_hf(hf_dir("qwen3-gqa")[0])
    cfg = TrainConfig(steps=1, eviction=EvictionSection(sinks=2, window=6, topk=10, kvpop=KVpopSection(scorer=scorer)))
    student = Student(model, student_scorers(cfg, model.config, 0))
    tokens = np.random.RandomState(3).randint(3, 97, (2, 48))
    trained, _ = sparse_student_forward(student, jnp.asarray(tokens), cfg)
    policy = student_policy(student.scorers, cfg)
    np.testing.assert_allclose(np.asarray(trained), np.asarray(sparse_logits(model, tokens, policy)), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(trained), np.asarray(stepwise_logits(model, tokens, policy)), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(trained) - np.asarray(kvjax.forward(model, tokens))).max() > 1e-2
