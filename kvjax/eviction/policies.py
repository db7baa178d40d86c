"""Eviction policies over one bounded cache: each only produces priorities.

Static-priority policies (a token's priority is fixed once it exists) use the keep
rule's Fenwick path at prefill and the online top-k buffer in decoding; the two are the
same set. Heuristics whose scores change over time keep an attention statistic per slot
(``score``), re-rank their long-range slots by it each step, and prefill with dense
attention followed by selection, as kvpress does.

| name           | priority of token ``t`` (higher = kept)                               |
|----------------|-----------------------------------------------------------------------|
| streaming_llm  | none: all ``k`` slots go to the window (``w + k`` recent tokens)       |
| random         | a seeded hash of (layer, head, ``t``)                                 |
| knorm          | ``-||k_t||_2`` (low key norm = important), to 13 mantissa bits (:func:`_coarse`) |
| oracle         | given: the dense teacher's future attention (known in hindsight)      |
| oracle_peak    | given, like ``oracle``; by convention the peak single-query attention  |
| oracle_union   | given, like ``oracle``; by convention the better of the two ranks above |
| oracle_values  | given, like ``oracle``; the testbed's fact values first (a diagnostic)  |
| tova           | attention from the latest query (mean over the KV head's group)        |
| kvzip          | the most attention a token gets while the model repeats its context (:mod:`kvjax.eviction.kvzip`; prefill compression) |
| keydiff        | ``-cos(k_t, mean normalised key)``, the anchor over the context, or the slots held (:mod:`kvjax.eviction.keydiff`) |
| h2o            | attention accumulated over all queries so far                          |
| pyramidkv      | SnapKV's, with PyramidKV's layer budgets (:mod:`kvjax.eviction.budgets`)  |
| adakv          | SnapKV's, with Ada-KV's per-head split from the scores                  |
| snapkv         | attention from an observation window: at prefill the last ``obs`` queries, pooled over positions (kernel ``pool``); in decoding, every ``obs`` steps all slots are re-ranked by the attention of the ``obs`` queries since the last refresh (no pooling: slots are not contiguous) |
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax.eviction.bounded import AttentionStatistic, BoundedPolicy, StaticPriority
from kvjax.eviction.config import DEFAULT_COMPRESSION, DEFAULT_SINKS, DEFAULT_WINDOW, EvictionConfig
from kvjax.eviction.registry import REGISTRY, register


def _hash_uniform(seed: int, layer: int, head_K, t):
    """Deterministic uniform [0, 1) from integers (a 32-bit avalanche mix)."""
    x = (jnp.asarray(t, jnp.uint32) * jnp.uint32(0x9E3779B1)) ^ (jnp.asarray(head_K, jnp.uint32) * jnp.uint32(0x85EBCA77))
    x = x ^ jnp.uint32((seed * 0x27D4EB2F + layer * 0x165667B1) & 0xFFFFFFFF)
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, 1)):
        x = (x ^ (x >> shift)) * jnp.uint32(mul)
    return (x >> 8).astype(jnp.float32) / jnp.float32(1 << 24)


@register
@dataclasses.dataclass(frozen=True)
class StreamingLLM(StaticPriority):
    name: ClassVar[str] = "streaming_llm"

    def effective(self) -> EvictionConfig:
        c = self.config
        return dataclasses.replace(c, window=c.window + c.topk, topk=0, k_max=0)

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        return jnp.zeros((k_BSKD.shape[0], k_BSKD.shape[2], k_BSKD.shape[1]), jnp.float32)


@register
@dataclasses.dataclass(frozen=True)
class RandomPolicy(StaticPriority):
    name: ClassVar[str] = "random"

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        K = k_BSKD.shape[2]
        return _hash_uniform(self.config.seed, layer, jnp.arange(K)[None, :, None], t_BS[:, None, :])


@register
@dataclasses.dataclass(frozen=True)
class KNorm(StaticPriority):
    name: ClassVar[str] = "knorm"

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        norm_BSK = jnp.linalg.norm(k_BSKD.astype(jnp.float32), axis=-1)
        return -jnp.swapaxes(_coarse(norm_BSK), 1, 2)


def _coarse(x, drop_bits: int = 10):
    """``x`` with the low ``drop_bits`` of its 23 float32 mantissa bits cleared (relative step
    ``2**-13``). RoPE leaves a key's norm unchanged, so a token repeated in layer 0 has one
    norm in exact arithmetic; in float32 the norms differ in the last bits, by position and by
    the compiled program's shapes. Coarsened, such keys tie exactly and the keep rule breaks the
    tie the same way whatever the shapes (length buckets, chunked prefill, another CPU)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type(bits & jnp.int32(-(1 << drop_bits)), jnp.float32)


@register
@dataclasses.dataclass(frozen=True)
class Oracle(StaticPriority):
    """``params``: ``float [L, B, K, T]`` priorities by position (e.g. the dense
    teacher's log future-attention mass, :func:`kvjax.future_attention_target`)."""

    name: ClassVar[str] = "oracle"
    table_priorities: ClassVar[bool] = True       # known before the pass: budgets may span layers
    comparable_priorities: ClassVar[bool] = True  # log future-attention mass: one scale for every head

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        if params is None:
            raise ValueError(f"the {self.name} policy needs priorities: "
                             f"{type(self).__name__}(config, params=array [L, B, K, T])")
        table = params[layer]                                            # [B, K, T]
        idx = jnp.clip(t_BS, 0, table.shape[-1] - 1)[:, None, :]
        return jnp.take_along_axis(table, jnp.broadcast_to(idx, table.shape[:2] + idx.shape[-1:]), axis=-1)


@register
@dataclasses.dataclass(frozen=True)
class OraclePeak(Oracle):
    """The oracle's mechanism under its own name, so a table can hold both hindsight
    rankings: ``params`` are :func:`kvjax.targets.peak_future_attention` per layer."""

    name: ClassVar[str] = "oracle_peak"


@register
@dataclasses.dataclass(frozen=True)
class OracleUnion(Oracle):
    """The oracle's mechanism for ``kvjax.evaluation.oracle_priorities(kind="union")``."""

    name: ClassVar[str] = "oracle_union"


@register
@dataclasses.dataclass(frozen=True)
class OracleValues(Oracle):
    """The oracle's mechanism for the testbed's "keep every fact value" diagnostic
    (:meth:`kvjax.evaluation.quality.BatchContext.oracle_params` with kind ``"values"``)."""

    name: ClassVar[str] = "oracle_values"


@register
@dataclasses.dataclass(frozen=True)
class TOVA(AttentionStatistic):
    name: ClassVar[str] = "tova"

    score_rows: ClassVar[int | None] = 1          # reads the last query only

    def prefill_scores(self, probs_BKGRS, lengths_B, qpos_BR):
        last = (qpos_BR == (lengths_B - 1)[:, None])[:, None, None, :, None]
        return jnp.sum(jnp.where(last, probs_BKGRS, 0.0), axis=3).mean(axis=2)

    def update_scores(self, scores_BKN, probs_BKN):
        return probs_BKN


@register
@dataclasses.dataclass(frozen=True)
class H2O(AttentionStatistic):
    name: ClassVar[str] = "h2o"
    columnwise: ClassVar[bool] = True             # column sums: query blocks skip the later keys

    def prefill_scores(self, probs_BKGRS, lengths_B, qpos_BR):
        real_q = (qpos_BR < lengths_B[:, None])[:, None, None, :, None]
        return jnp.sum(jnp.where(real_q, probs_BKGRS, 0.0), axis=3).mean(axis=2)

    def update_scores(self, scores_BKN, probs_BKN):
        return scores_BKN + probs_BKN


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(AttentionStatistic):
    name: ClassVar[str] = "snapkv"

    @property
    def score_rows(self) -> int:                  # reads the observation window's queries only
        return self.config.obs_window

    def prefill_scores(self, probs_BKGRS, lengths_B, qpos_BR):
        n = lengths_B[:, None]
        obs = (qpos_BR >= 0) & (qpos_BR < n) & (qpos_BR >= n - self.config.obs_window)
        summed = jnp.sum(jnp.where(obs[:, None, None, :, None], probs_BKGRS, 0.0), axis=3).mean(axis=2)
        pad = self.config.pool // 2
        return jax.lax.reduce_window(jnp.pad(summed, ((0, 0), (0, 0), (pad, pad))), 0.0, jax.lax.add,
                                     (1, 1, self.config.pool), (1, 1, 1), "VALID") / self.config.pool

    def update_scores(self, scores_BKN, probs_BKN):
        return scores_BKN + probs_BKN

    def rank(self, buf, state):
        return buf                             # rankings hold until the next refresh

    def refresh(self, buf, state, q_B):
        """Every ``obs_window`` steps (the window of observed queries has refilled), every
        slot is re-ranked by the attention those queries paid it, and the sums restart."""
        due = (jnp.mod(q_B + 1, self.config.obs_window) == 0)[:, None, None]
        return (buf.replace(prio=jnp.where(due, state.score, buf.prio)),
                state.replace(score=jnp.where(due, 0.0, state.score)))


@register
@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024, arXiv:2406.02069): SnapKV's ranking within a layer, layer
    budgets falling linearly with depth at the same total (``budgets="pyramid"``, beta 20, as
    the paper and kvpress); a layer holds at most ``k_max`` long-range tokens per head
    (default ``2 topk``, the pyramid's widest layer)."""

    name: ClassVar[str] = "pyramidkv"

    def effective(self) -> EvictionConfig:
        c = self.config
        return dataclasses.replace(c, budgets="pyramid", k_max=2 * c.topk if c.k_max is None else c.k_max)


@register
@dataclasses.dataclass(frozen=True)
class AdaKV(SnapKV):
    """Ada-KV (Feng et al. 2024, arXiv:2407.11550) over SnapKV, as kvpress's
    ``AdaKVPress(SnapKVPress())``: per layer the best candidates of all heads (``budgets="adakv"``,
    safeguard alpha 0.2), re-split at every SnapKV refresh when bounded throughout; a head holds
    at most ``k_max`` long-range tokens (default ``2 topk``). Other rankers take Ada-KV's split
    with ``EvictionConfig(budgets="adakv")``."""

    name: ClassVar[str] = "adakv"

    def effective(self) -> EvictionConfig:
        c = self.config
        return dataclasses.replace(c, budgets="adakv", k_max=2 * c.topk if c.k_max is None else c.k_max)


from kvjax.eviction import dms, duo_attention, keydiff, kvzip, learned, lkv_policies  # noqa: E402,F401  (they register their policies)



def make_policy(name: str, config: EvictionConfig | None = None, params: Any = None, *,
                compression: float | None = None) -> BoundedPolicy:
    """The registered policy ``name`` with ``params`` and its budget: ``config`` (a fixed budget
    per KV head), or ``compression`` (the share of the prompt evicted, resolved at the prompt's
    length by ``generate``; ``config``, with ``topk=0``, then gives the sinks, window and other
    settings; a config with ``topk > 0`` and a compression together are refused). With
    neither, the budget is :data:`~kvjax.eviction.config.DEFAULT_COMPRESSION` (75%) with
    ``DEFAULT_SINKS`` (4) sinks and a ``DEFAULT_WINDOW`` (32) token window."""
    if name not in REGISTRY:
        raise ValueError(f"policy: unknown name {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    if config is None:
        config = EvictionConfig(sinks=DEFAULT_SINKS, window=DEFAULT_WINDOW, topk=0)
        compression = DEFAULT_COMPRESSION if compression is None else compression
    return REGISTRY[name](config, params=params, compression=compression)


__all__ = ["REGISTRY", "make_policy", "register", "BoundedPolicy", "StaticPriority", "AttentionStatistic"]
