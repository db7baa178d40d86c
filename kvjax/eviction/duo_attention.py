"""DuoAttention (Xiao et al. 2024, arXiv:2410.10819) on the one bounded cache.

Each KV head is a *retrieval* head (it keeps its context, up to the cap ``k_max``) or a
*streaming* head (sinks + window only). Which heads retrieve is learned once per model: a gate
``alpha_lh in [0, 1]`` per KV head mixes full and streaming attention,

    attn_lh = alpha_lh * full_attn + (1 - alpha_lh) * streaming_attn,

and is optimised on synthetic passkey retrieval with the model frozen (:mod:`kvjax.duo`).
At inference the gates are thresholded to a ratio: at the same total memory as a uniform
budget (``L K topk`` long-range slots), the ``R = floor(L K topk / k_max)`` heads with the
largest gates retrieve (``k_max`` slots each), the next head takes the remainder, and every
other head streams (0 long-range slots). Within a retrieval head nothing is ranked: the most
recent tokens stay (priority = position), so the policy measures allocation alone.
``params = {"gates": float [L, K]}``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.eviction.bounded import StaticPriority
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.registry import register


def duo_budgets(gates_LK, topk: int, cap: int) -> jax.Array:
    """``int32 [L, K]``: ``cap`` long-range slots for the heads of largest gate until
    ``L K topk`` are given (the last one partial), 0 for the rest (ties: the earlier head)."""
    g = jnp.asarray(gates_LK, jnp.float32)
    if cap < topk:
        raise ValueError(f"duo_attention: a retrieval head's cap k_max={cap} is below topk={topk}")
    total = g.size * topk
    full, rest = (total // cap, total % cap) if cap > 0 else (0, 0)
    order = jnp.argsort(-g.reshape(-1), stable=True)
    rank = jnp.zeros(g.size, jnp.int32).at[order].set(jnp.arange(g.size, dtype=jnp.int32))
    out = jnp.where(rank < full, cap, jnp.where(rank == full, rest, 0))
    return out.reshape(g.shape).astype(jnp.int32)


@register
@dataclasses.dataclass(frozen=True)
class DuoAttention(StaticPriority):
    """Retrieval heads keep their most recent ``k_max`` long-range tokens, streaming heads none
    (see the module docstring). ``config.k_max`` is a retrieval head's cap (required: the
    evaluation sets it to the context length, so retrieval heads keep everything)."""

    name: ClassVar[str] = "duo_attention"
    export_kind: ClassVar[str] = "duo"          # its gates: kvjax.duo.export_gates

    def gates(self, params):
        if not isinstance(params, dict) or "gates" not in params:
            raise ValueError("the duo_attention policy needs trained gates: params={'gates': float [L, K]} "
                             "(kvjax.duo trains them; kvjax.load_scorers(dir) loads an export)")
        return params["gates"]

    def at_budget(self, config: EvictionConfig, context: int | None = None) -> "DuoAttention":
        """At ``config``'s total; retrieval heads keep up to ``context`` tokens (their cap ``k_max =
        context - sinks - window``) unless ``config.k_max`` sets the cap."""
        if config.k_max is None:
            if context is None:
                raise ValueError("duo_attention: give the context length (at_budget(config, context=...)) or "
                                 "config.k_max: a retrieval head's cap")
            config = dataclasses.replace(config, k_max=max(context - config.sinks - config.window, config.topk))
        return dataclasses.replace(self, config=config, compression=None)

    def effective(self) -> EvictionConfig:
        if self.config.k_max is None:
            raise ValueError("duo_attention: set EvictionConfig.k_max, a retrieval head's cap "
                             "(e.g. the context length minus sinks and window)")
        return self.config

    def head_budgets(self, params, cfg, batch: int):
        gates = self.gates(params)
        if tuple(gates.shape) != (cfg.num_layers, cfg.num_kv_heads):
            raise ValueError(f"duo_attention: gates have shape {gates.shape}, the model needs "
                             f"[layers, kv_heads] = {(cfg.num_layers, cfg.num_kv_heads)}")
        ev = self.effective()
        b = duo_budgets(gates, ev.topk, ev.slots)
        return jnp.broadcast_to(b[:, None, :], (cfg.num_layers, batch, cfg.num_kv_heads))

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        B, S, K, _ = k_BSKD.shape
        return jnp.broadcast_to(jnp.asarray(t_BS, jnp.float32)[:, None, :], (B, K, S))
