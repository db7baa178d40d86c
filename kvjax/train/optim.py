"""Optimiser: AdamW with warmup + cosine, global-norm clipping, per-group learning rates,
non-finite step skipping (counted), and a per-phase trainable mask.

Groups are chosen by parameter path: ``scorers`` (KVpop scorer weights), ``lkv``
(LKV heads), everything else ``backbone``; each group has its own peak learning rate.
"""

from __future__ import annotations

import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kvjax.train.config import OptimSection

GROUPS = ("backbone", "scorers", "lkv")


def path_str(path) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def param_group(path: str) -> str:
    if path.startswith("scorers") or ".scorers." in path:
        return "scorers"
    if path.startswith("lkv") or ".lkv." in path:
        return "lkv"
    return "backbone"


def schedule(peak: float, cfg: OptimSection, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=peak * cfg.min_lr_ratio)


def make_optimizer(cfg: OptimSection, params, total_steps: int,
                   phase_steps: Sequence[int] | None = None) -> tuple[optax.GradientTransformation, dict]:
    """``(optimizer, {group: schedule})`` for the param pytree ``params``; with
    ``cfg.schedule_per_phase``, warmup + cosine restart at each phase of ``phase_steps``."""
    peaks = {"backbone": cfg.lr, "scorers": cfg.lr_scorers, "lkv": cfg.lr_lkv}
    if cfg.schedule_per_phase and phase_steps and len(phase_steps) > 1:
        bounds = list(np.cumsum(phase_steps)[:-1])
        scheds = {g: optax.join_schedules([schedule(peaks[g], cfg, n) for n in phase_steps], bounds)
                  for g in GROUPS}
    else:
        scheds = {g: schedule(peaks[g], cfg, total_steps) for g in GROUPS}
    labels = jax.tree_util.tree_map_with_path(lambda p, _: param_group(path_str(p)), params)
    inner = optax.multi_transform(
        {g: optax.adamw(scheds[g], b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
         for g in GROUPS}, labels)
    opt = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), inner) if cfg.clip_norm > 0 else inner
    return optax.apply_if_finite(opt, max_consecutive_errors=1_000_000), scheds


def trainable_mask(params, patterns: Sequence[str]):
    """1.0 for parameters whose path matches any regex in ``patterns`` (all when empty)."""
    regs = [re.compile(p) for p in patterns]
    hits: list[str] = []

    def one(path, x):
        s = path_str(path)
        on = not regs or any(r.search(s) for r in regs)
        if on:
            hits.append(s)
        return jnp.asarray(1.0 if on else 0.0, jnp.float32)

    mask = jax.tree_util.tree_map_with_path(one, params)
    if regs and not hits:
        raise ValueError(f"trainable patterns {list(patterns)} match no parameter")
    return mask


def param_count(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def split_params(model):
    """``(graphdef, params)`` with params a plain nested-dict pytree of arrays."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)

