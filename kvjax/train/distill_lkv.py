"""``distill_lkv``: LKV-H budgets and LKV-T token scorers trained end to end against the
frozen dense model (seed ``002``, "Training Objective").

The backbone is frozen (it is the teacher, held once as the step's read-only pytree);
only the LKV weights train. Per layer of the student's forward the LKV-T scores ``u`` of
``[k; v]`` and the soft budget ``b_lh = r_lh k_max`` (LKV-H's ratios, keep ratio
``R = topk / k_max``) give the soft keep weights ``m~ = ST_b((u + g) / tau)`` of
:mod:`kvjax.lkv.soft_mask`, which multiply the attention weights. Loss:

    L = KL(P_T || P_S) + beta / L * sum_l || H_T^(l) - H_S^(l) ||^2

with ``tau`` annealed geometrically from ``gumbel_start`` to ``gumbel_end``. At inference
the ``lkv`` policy keeps the hard top-``floor(r_lh k_max)`` of ``u`` per head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.eviction.config import EvictionConfig
from kvjax.lkv import LKVHeads, LKVTokenScorer, gumbel_temperature
from kvjax.lkv.soft_mask import soft_keep_weights, soft_masked_attention
from kvjax.losses import hidden_mse, kl_distill
from kvjax.train.config import TrainConfig
from kvjax.train.model_init import build_model
from kvjax.train.optim import split_params


class LKVModules(nnx.Module):
    """LKV-H and LKV-T of one model."""

    def __init__(self, heads: LKVHeads, tokens: LKVTokenScorer):
        self.heads = heads
        self.tokens = tokens


class LKVStudent(nnx.Module):
    """The trainable part of ``distill_lkv`` (under ``lkv``: the optimiser's ``lkv`` group)."""

    def __init__(self, lkv: LKVModules):
        self.lkv = lkv


def make_lkv(cfg: TrainConfig, model_cfg, seed: int) -> LKVStudent:
    ev, rngs = cfg.eviction, nnx.Rngs(seed + 29)
    heads = LKVHeads(model_cfg.num_layers, model_cfg.num_kv_heads, ev.lkv.embed_dim, ev.lkv.head_hidden, rngs=rngs)
    tokens = LKVTokenScorer(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, ev.lkv.token_hidden,
                            rngs=rngs)
    return LKVStudent(LKVModules(heads, tokens))


def lkv_eviction_config(cfg: TrainConfig) -> EvictionConfig:
    """The inference budget the trained LKV weights are meant for."""
    ev = cfg.eviction
    return EvictionConfig(sinks=ev.sinks, window=ev.window, topk=ev.topk, k_max=ev.k_max)


def soft_student_forward(model, lkv: LKVModules, tokens_BS, cfg: TrainConfig, rng, temperature):
    """Student logits and per-layer residual streams under the soft LKV keep weights."""
    ev = cfg.eviction
    k_max = ev.k_max
    budget_LK = lkv.heads.ratios(ev.topk / k_max) * k_max

    def backend(layer, q, k, v, positions, state):
        u_BKS = lkv.tokens.scores(layer, k, v)
        noise = jax.random.gumbel(jax.random.fold_in(rng, layer), u_BKS.shape, jnp.float32)
        budget_BK = jnp.broadcast_to(budget_LK[layer], u_BKS.shape[:2])
        w = soft_keep_weights(u_BKS, budget_BK, sinks=ev.sinks, window=ev.window, temperature=temperature,
                              noise_BKS=noise)
        return soft_masked_attention(q, k, v, w), state

    h, _, per_layer = model(tokens_BS, None, backend, None, layer_outputs=True)
    return model.logits(h), per_layer


def distill_lkv_task(cfg: TrainConfig, *, abstract: bool = False):
    from kvjax.train.task import Task

    ev = cfg.eviction
    backbone = build_model(cfg.model, cfg.seed, abstract=abstract)
    make = functools.partial(make_lkv, cfg, backbone.config, cfg.seed)
    student = nnx.eval_shape(make) if abstract else make()
    graphdef, params = split_params(student)
    b_def, b_params = split_params(backbone)
    anneal = ev.lkv.gumbel_steps or cfg.total_steps

    def loss_fn(p, frozen, batch, rng, step):
        model = nnx.merge(b_def, frozen)
        lkv = nnx.merge(graphdef, p).lkv
        th, _, t_layers = model(batch["tokens"], layer_outputs=True)
        t_logits = jax.lax.stop_gradient(model.logits(th))
        tau = gumbel_temperature(step, ev.lkv.gumbel_start, ev.lkv.gumbel_end, anneal)
        s_logits, s_layers = soft_student_forward(model, lkv, batch["tokens"], cfg, rng, tau)
        mask = batch["loss_mask"]
        kd = kl_distill(t_logits, s_logits, mask)
        mse = hidden_mse(jax.lax.stop_gradient(t_layers), s_layers, mask) / len(s_layers)
        return kd + ev.lkv.hidden_weight * mse, {"kd": kd, "hidden_mse": mse, "gumbel_tau": tau}

    def to_model(p):
        return nnx.merge(b_def, b_params)

    return Task(graphdef, params, loss_fn, ("tokens", "loss_mask"), frozen=b_params, frozen_def=b_def,
                to_model=to_model)
