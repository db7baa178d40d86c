"""``distill_kvpop``: a dense frozen teacher distils into a sparse student (the same
weights, attending under the keep rule of its own KVpop scorer).

Per layer of the student's forward: scorer scores ``r_hat`` on ``stop_gradient([k; v])``,
static priorities ``p_hat = r_hat + lambda t``, their ranks and Fenwick cutoffs, the
keep-rule attention returning the log-sum-exp, and the future-attention target ``r_tgt``
from a transposed pass reusing that LSE (``stop_gradient``) -- both by the
``pallas_kernels`` ops, on the backend ``eviction.kernel`` names. Loss:

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
from flax import nnx

import pallas_kernels
from kvjax.eviction.fenwick import cutoffs_from_ranks, token_ranks
from kvjax.losses import boundary_pairwise_loss, cached_topk_kl, kl_distill, regression_loss, topk_kl_distill
from kvjax.scorers import MLPScorer, MLSTMScorer
from kvjax.eviction.keep_rule import static_priority
from kvjax.train.config import TrainConfig
from kvjax.train.model_init import build_model
from kvjax.train.optim import split_params
from kvjax.train.teacher_cache import teacher_section


class Student(nnx.Module):
    """The sparse student: a backbone and its KVpop scorers (``scorers.*`` train at ``lr_scorers``)."""

    def __init__(self, backbone, scorers):
        self.backbone = backbone
        self.scorers = scorers


def make_scorer(cfg: TrainConfig, model_cfg, seed: int):
    ev = cfg.eviction
    rngs = nnx.Rngs(seed + 17)
    if ev.kvpop.scorer == "mlp":
        return MLPScorer(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, ev.kvpop.hidden, rngs=rngs)
    return MLSTMScorer(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, ev.kvpop.mlstm_qk_dim,
                       readout_norm=ev.kvpop.mlstm_readout_norm, rngs=rngs)


def scorer_outputs(scorer, layer, k_BSKD, v_BSKD, positions_BS, window: int, chunk: int):
    """``(r_hat, p_hat)`` ``[B, K, S]`` for a whole sequence."""
    if isinstance(scorer, MLSTMScorer):
        r = scorer.scores(layer, k_BSKD, v_BSKD, window, chunk=chunk)
    else:
        r = scorer.scores(layer, k_BSKD, v_BSKD)
    return r, static_priority(r, scorer.decay(layer), positions_BS[:, None, :])


def sparse_student_forward(student: Student, tokens_BS, cfg: TrainConfig):
    """Student logits under its keep rule, and per-layer ``(r_hat, p_hat, r_tgt)``."""
    ev = cfg.eviction

    kernel = dict(backend=ev.kernel, interpret=ev.kernel_interpret)

    def backend(layer, q, k, v, positions, acc):
        r_hat, p_hat = scorer_outputs(student.scorers, layer, k, v, positions, ev.window, ev.kvpop.mlstm_chunk)
        rank = token_ranks(jax.lax.stop_gradient(p_hat))
        cut = cutoffs_from_ranks(rank, sinks=ev.sinks, window=ev.window, topk=ev.topk)
        out, lse = pallas_kernels.sparse_attention(q, k, v, rank, cut, sinks=ev.sinks, window=ev.window, **kernel)
        sg = jax.lax.stop_gradient
        tgt = pallas_kernels.transposed_target(sg(q), sg(k), sg(lse), window=ev.window, **kernel)
        return out, acc + ((r_hat, p_hat, sg(tgt)),)

    h, per_layer = student.backbone(tokens_BS, None, backend, ())
    return student.backbone.logits(h), per_layer


def distill_kvpop_task(cfg: TrainConfig, *, abstract: bool = False):
    from kvjax.train.task import Task

    ev = cfg.eviction
    cached = cfg.data.teacher_cache is not None     # the teacher's top-k arrives with the batch: no teacher here
    teacher = None if cached else build_model(teacher_section(cfg), cfg.seed, abstract=abstract)
    backbone = build_model(cfg.model, cfg.seed, abstract=abstract)
    make = functools.partial(make_scorer, cfg, backbone.config, cfg.seed)
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
