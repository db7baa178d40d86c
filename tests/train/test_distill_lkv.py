"""distill_lkv: the KL and hidden-state loss reach LKV-H and LKV-T (and nothing else trains),
the loss falls on a short CPU run, and the trained weights run as the ``lkv`` policy with
the sparse pass equal to step-by-step decoding."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax.eviction.forced import sparse_logits, stepwise_logits
from kvjax.eviction.lkv_policies import LKV
from kvjax.export import export_scorers, load_scorers
from kvjax.train.loop import train
from kvjax.train.tasks import make_task
from train_helpers import tiny_config

LKV_RUN = {"eviction.sinks": 2, "eviction.window": 8, "eviction.topk": 16, "eviction.k_max": 32, "optim.lr_lkv": 1e-2,
           "model.init_std": 0.3, "eviction.lkv.gumbel_start": 0.5, "eviction.lkv.gumbel_end": 0.5}


def test_gradients_reach_both_lkv_parts_only(tmp_path):
    task = make_task(tiny_config(tmp_path, mode="distill_lkv", **LKV_RUN))
    assert set(task.params) == {"lkv"} and set(task.params["lkv"]) == {"heads", "tokens"}
    batch = {"tokens": jnp.asarray(np.random.RandomState(0).randint(3, 299, (2, 96))),
             "loss_mask": jnp.ones((2, 96), bool)}
    (loss, aux), g = jax.value_and_grad(task.loss_fn, has_aux=True)(task.params, task.frozen, batch,
                                                                     jax.random.key(0), jnp.int32(0))
    assert np.isfinite(float(loss)) and float(aux["kd"]) > 0 and float(aux["hidden_mse"]) > 0
    for part in ("heads", "tokens"):
        leaves = jax.tree.leaves(g["lkv"][part])
        assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
        assert any(np.abs(np.asarray(x)).max() > 0 for x in leaves), part


def test_loss_falls_and_trained_policy_decodes_like_its_sparse_pass(tmp_path):
    cfg = tiny_config(tmp_path / "run", mode="distill_lkv", steps=40, **LKV_RUN)
    train(cfg, quiet=True)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    first, last = rows[0]["loss"], np.mean([r["loss"] for r in rows[-3:]])
    assert last < 0.85 * first, (first, last)
    policy = load_scorers(export_scorers(tmp_path / "run", tmp_path / "scorers"), compression=None)
    assert isinstance(policy, LKV)
    b = np.asarray(policy.params["budgets"])
    assert b.sum() <= 2 * 2 * 16 and (b <= 32).all()
    model = make_task(cfg).model()
    tokens = np.random.RandomState(2).randint(3, 299, (2, 100))
    np.testing.assert_allclose(np.asarray(sparse_logits(model, tokens, policy)),
                               np.asarray(stepwise_logits(model, tokens, policy)), atol=1e-5, rtol=0)
    assert kvjax.generate(model, [[1, 5, 9]], 10, policy=policy, eos_token_id=[]).shape == (1, 13)
