"""What each training mode optimises: its trainable parameters and its loss.

``pretrain``: plain next-token cross entropy (the testbed teacher); ``distill_kvpop`` and
``distill_lkv`` live in their own modules.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from flax import nnx

from kvjax.data.testbed import LOOKUP_FAR, LOOKUP_NEAR
from kvjax.train.config import TrainConfig
from kvjax.train.key_dropout import key_dropout_attention, rate_at
from kvjax.train.model_init import build_model
from kvjax.train.optim import split_params
from kvjax.losses import lm_loss
from kvjax.train.task import Task


def pretrain_task(cfg: TrainConfig, *, abstract: bool = False) -> Task:
    model = build_model(cfg.model, cfg.seed, abstract=abstract)
    graphdef, params = split_params(model)
    loss_on_trace = cfg.data.loss_on == "trace"
    weigh_lookups = cfg.data.lookup_weight != 1.0
    phases = cfg.all_phases()
    rates, windows = [p.key_dropout for p in phases], {p.key_dropout_window for p in phases if p.key_dropout}
    if len(windows) > 1:
        raise ValueError(f"phases with key_dropout must share one key_dropout_window, got {sorted(windows)}")

    def loss_fn(p, frozen, batch, rng, step):
        m = nnx.merge(graphdef, p)
        if any(rates):
            rate = rate_at(rates, [q.steps for q in phases], step)
            backend = key_dropout_attention(rng, rate, next(iter(windows)))
            h, _ = m(batch["tokens"], None, backend, None)
        else:
            h, _ = m(batch["tokens"])
        mask = batch["loss_mask"]
        if loss_on_trace:
            mask = mask & (jnp.arange(mask.shape[1])[None] >= batch["prompt_len"][:, None])
        if weigh_lookups:  # lookups are few and the answer hangs on them: give them more of the loss
            is_lookup = (batch["category"] == LOOKUP_NEAR) | (batch["category"] == LOOKUP_FAR)
            mask = mask * jnp.where(is_lookup, cfg.data.lookup_weight, 1.0)
        return lm_loss(m.logits(h), batch["tokens"], mask), {}

    keys = (("tokens", "loss_mask") + (("prompt_len",) if loss_on_trace else ())
            + (("category",) if weigh_lookups else ()))
    return Task(graphdef, params, loss_fn, keys)


def _distill_kvpop(cfg, *, abstract=False):
    from kvjax.train.distill_kvpop import distill_kvpop_task

    return distill_kvpop_task(cfg, abstract=abstract)


def _distill_lkv(cfg, *, abstract=False):
    from kvjax.train.distill_lkv import distill_lkv_task

    return distill_lkv_task(cfg, abstract=abstract)


TASKS: dict[str, Callable[..., Task]] = {"pretrain": pretrain_task, "distill_kvpop": _distill_kvpop,
                                         "distill_lkv": _distill_lkv}


def make_task(cfg: TrainConfig, *, abstract: bool = False) -> Task:
    if cfg.mode not in TASKS:
        raise ValueError(f"mode: {cfg.mode!r} is not available; available modes: {', '.join(TASKS)}")
    return TASKS[cfg.mode](cfg, abstract=abstract)
