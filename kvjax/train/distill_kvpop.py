"""``distill_kvpop``: a dense frozen teacher distils into a sparse student (the same
weights, attending under the keep rule of its own KVpop scorer).

Per layer of the student's forward, through the methods of the KVpop policy that decoding runs
(:func:`student_policy`, so the trained attention is the decoded one by construction): scorer
scores ``r_hat`` on ``stop_gradient([k; v])`` and static priorities ``p_hat = r_hat + lambda t``
(``scores_and_priority``), the keep-rule attention of the ranks and Fenwick cutoffs, returning
the log-sum-exp (``sparse_attention``, every head at ``eviction.topk``), and the
future-attention target ``r_tgt`` from a transposed pass reusing that LSE (``stop_gradient``)
-- by the ``pallas_kernels`` ops, on the backend ``eviction.kernel`` names. Loss:

    kd_weight * KL(teacher || student)                       -> backbone only
                      (``data.teacher_cache``: the teacher's top-k computed once,
                       ``cached_topk_kl``; no teacher runs in the step)
  + regression_weight * mean_l MSE(r_hat_l, r_tgt_l)          -> scorers only
                      (``regression_centred``: up to a per-(row, head) offset)
  + pairwise_weight * mean_l boundary_pairwise(p_hat_l, r_tgt_l)  -> scorers only
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.learned import from_scorer
from kvjax.losses import boundary_pairwise_loss, cached_topk_kl, kl_distill, regression_loss, topk_kl_distill
from kvjax.scorers.build import make_scorer
from kvjax.train.config import TrainConfig
from kvjax.train.model_init import build_model
from kvjax.train.optim import split_params
from kvjax.train.teacher_cache import teacher_section


class Student(nnx.Module):
    """The sparse student: a backbone and its KVpop scorers (``scorers.*`` train at ``lr_scorers``)."""

    def __init__(self, backbone, scorers):
        self.backbone = backbone
        self.scorers = scorers


def student_scorers(cfg: TrainConfig, model_cfg, seed: int):
    """The run's fresh scorers (:func:`kvjax.scorers.build.make_scorer`)."""
    kp = cfg.eviction.kvpop
    return make_scorer(kp.scorer, model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, hidden=kp.hidden,
                       qk_dim=kp.mlstm_qk_dim, readout_norm=kp.mlstm_readout_norm, seed=seed + 17)


def student_policy(scorers, cfg: TrainConfig):
    """The KVpop policy of ``scorers`` at the run's uniform budget (``eviction.sinks/window/topk``,
    its kernel): the policy a ``distill_kvpop`` step trains through and :mod:`kvjax.export` ships."""
    ev = cfg.eviction
    conf = EvictionConfig(ev.sinks, ev.window, ev.topk, kernel=ev.kernel, kernel_interpret=ev.kernel_interpret)
    return from_scorer(scorers, conf, chunk=ev.kvpop.mlstm_chunk)


def sparse_student_forward(student: Student, tokens_BS, cfg: TrainConfig):
    """Student logits under its keep rule, and per-layer ``(r_hat, p_hat, r_tgt)``."""
    ev = cfg.eviction
    policy = student_policy(student.scorers, cfg)
    sg = jax.lax.stop_gradient

    def backend(layer, q, k, v, positions, acc):
        r_hat, p_hat, _ = policy.scores_and_priority(policy.params, layer, k, v, positions)
        budget_BK = jnp.full(p_hat.shape[:2], ev.topk, jnp.int32)
        out, lse = policy.sparse_attention(q, k, v, sg(p_hat), budget_BK)
        tgt = pallas_kernels.transposed_target(sg(q), sg(k), sg(lse), window=ev.window, backend=ev.kernel,
                                               interpret=ev.kernel_interpret)
        return out, acc + ((r_hat, p_hat, sg(tgt)),)

    h, per_layer = student.backbone(tokens_BS, None, backend, ())
    return student.backbone.logits(h), per_layer


def distill_kvpop_task(cfg: TrainConfig, *, abstract: bool = False):
    from kvjax.train.task import Task

    ev = cfg.eviction
    cached = cfg.data.teacher_cache is not None     # the teacher's top-k arrives with the batch: no teacher here
    teacher = None if cached else build_model(teacher_section(cfg), cfg.seed, abstract=abstract)
    backbone = build_model(cfg.model, cfg.seed, abstract=abstract)
    make = functools.partial(student_scorers, cfg, backbone.config, cfg.seed)
    scorers = nnx.eval_shape(make) if abstract else make()
    student = Student(backbone, scorers)
    graphdef, params = split_params(student)
    t_def, t_params = (None, None) if cached else split_params(teacher)

    def distill_loss(frozen, batch, s_logits):
        mask = batch["loss_mask"]
        if cached:
            return cached_topk_kl(batch["teacher_logp"], batch["teacher_idx"], s_logits, mask)
        t_model = nnx.merge(t_def, frozen)
        th, _ = t_model(batch["tokens"])
        t_logits = jax.lax.stop_gradient(t_model.logits(th))
        return (kl_distill(t_logits, s_logits, mask) if ev.kd_topk <= 0
                else topk_kl_distill(t_logits, s_logits, mask, ev.kd_topk))

    def loss_fn(p, frozen, batch, rng, step):
        st = nnx.merge(graphdef, p)
        s_logits, per_layer = sparse_student_forward(st, batch["tokens"], cfg)
        kd = distill_loss(frozen, batch, s_logits)
        S = batch["tokens"].shape[1]
        sample = jax.random.bernoulli(rng, ev.kvpop.pairwise_frac, (S,))
        reg = sum(regression_loss(r, t, centred=ev.kvpop.regression_centred) for r, _, t in per_layer) / len(per_layer)
        pair = sum(boundary_pairwise_loss(ph, t, sinks=ev.sinks, window=ev.window, topk=ev.topk, sample_mask_S=sample)
                   for _, ph, t in per_layer) / len(per_layer)
        total = ev.kd_weight * kd + ev.kvpop.regression_weight * reg + ev.kvpop.pairwise_weight * pair
        return total, {"kd": kd, "regression": reg, "pairwise": pair}

    def to_model(p):
        return nnx.merge(graphdef, p).backbone

    keys = ("tokens", "loss_mask") + (("teacher_logp", "teacher_idx") if cached else ())
    return Task(graphdef, params, loss_fn, keys, frozen=t_params, frozen_def=t_def, to_model=to_model)
