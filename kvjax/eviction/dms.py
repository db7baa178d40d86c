"""DMS (Dynamic Memory Sparsification; Lancucki et al. 2025, arXiv:2506.05345) on the one
bounded cache.

DMS predicts, for every token ``t`` and KV head, a decision logit ``a_t``: evict (``a_t > 0``)
or keep. An eviction takes effect only after a delay of ``w`` tokens (the sliding window), so
the decision is known when the token is written but the token stays visible to the next ``w``
queries -- exactly kvjax's protected window. Training (:mod:`kvjax.dms`) relaxes the decision
with a Gumbel-sigmoid ``alpha_t = sigmoid((a_t + logit(u)) / tau)`` that multiplies the token's
attention weight by ``1 - alpha_t`` for queries ``q >= t + w``, and distils the dense model's
next-token distribution while pushing the mean ``alpha`` to the target eviction rate.

Here the decision is a linear function of the token's post-RoPE key and value per head,
``a_t = w_lh . [k_t; v_t] + b_lh`` (the paper reads it off one query/key neuron of a retrofitted
model; the backbone stays frozen here). At inference DMS frees a slot whenever ``a_t > 0``, a
ragged cache whose size varies by head and sequence; kvjax's cache has a fixed per-head budget,
so the decisions become a ranking (priority ``-a_t``: the tokens least inclined to be evicted
keep the long-range slots). ``params = {"w": float [L, K, 2D], "b": float [L, K]}``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.eviction.bounded import StaticPriority
from kvjax.eviction.registry import register


def dms_logits(w_KX, b_K, k_BSKD, v_BSKD):
    """Eviction logits ``a [B, K, S]`` of one layer: ``w . [k; v] + b`` per KV head."""
    x = jnp.concatenate([k_BSKD, v_BSKD], axis=-1).astype(jnp.float32)          # [B, S, K, 2D]
    return jnp.einsum("bskx,kx->bks", x, w_KX.astype(jnp.float32)) + b_K.astype(jnp.float32)[None, :, None]


@register
@dataclasses.dataclass(frozen=True)
class DMS(StaticPriority):
    """Priority ``-a_t`` from DMS's learned eviction logits (see the module docstring)."""

    name: ClassVar[str] = "dms"
    export_kind: ClassVar[str] = "dms"          # its weights: kvjax.dms.export_decisions

    def weights(self, params):
        if not isinstance(params, dict) or "w" not in params or "b" not in params:
            raise ValueError("the dms policy needs trained decisions: params={'w': [L, K, 2D], 'b': [L, K]} "
                             "(kvjax.dms trains them; kvjax.load_scorers(dir) loads an export)")
        return params["w"], params["b"]

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        w, b = self.weights(params)
        return -dms_logits(w[layer], b[layer], k_BSKD, v_BSKD)
