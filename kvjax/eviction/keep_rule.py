"""The keep rule: which keys each query may attend (docs/design.md, "The keep rule").

Per row with budget ``(s, w, k)``, query ``q`` attends key ``t <= q`` iff

    t < s                                   (sink)
    or q - w < t                            (protected window)
    or s <= t <= q - w and rank(t) <= tau_q (kept long-range, see ``fenwick``).

Two forms: the dense ``bool [S, S]`` mask (``keep_mask``) and the compact one
kernels use (``CompactKeep``: per-token ranks, per-query cutoffs, and which
``(query block, key block)`` tiles hold any kept key).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.keep_rule import block_any_kept, dense_keep_mask  # noqa: F401  (block_any_kept re-exported)

from kvjax.eviction.fenwick import (
    cutoffs_from_ranks,
    token_ranks,
    validate_budget,
    validate_size,
    validate_tokens,
)


class CompactKeep(NamedTuple):
    """Compact keep rule for rows ``[...]``: ``rank [..., S]`` (0 = best),
    ``cutoff [..., S]`` (``tau_q``), ``block_any_kept [..., nq, nk]`` (query block
    ``i`` has a kept key in key block ``j``)."""

    rank: jax.Array
    cutoff: jax.Array
    block_any_kept: jax.Array


def static_priority(scores_XS, decay_lambda_X, positions_XS=None) -> jax.Array:
    """``p_t = r_t + lambda * t``: ranking by ``p`` equals ranking by the decayed
    score ``r_t - lambda (q - t)`` at every ``q``. ``scores [..., S]``, ``decay_lambda``
    broadcastable to ``[...]`` (e.g. one per head), ``positions`` broadcastable to
    ``[..., S]`` (default ``0 .. S-1``) -> ``[..., S]``; ``-inf`` scores stay ``-inf``.
    The one definition: the scorers, the learned policies and ``distill_kvpop`` all call it."""
    scores_XS = jnp.asarray(scores_XS)
    t = jnp.arange(scores_XS.shape[-1]) if positions_XS is None else jnp.asarray(positions_XS)
    return scores_XS + jnp.asarray(decay_lambda_X, scores_XS.dtype)[..., None] * t.astype(scores_XS.dtype)


def keep_mask(priority_S, *, sinks: int, window: int, topk: int) -> jax.Array:
    """Dense keep rule for one head: ``priority [S]`` -> ``bool [S, S]``, ``[q, t]``
    true where query ``q`` may attend key ``t``."""
    priority_S = validate_tokens("priority", priority_S)
    if priority_S.ndim != 1:
        raise ValueError(f"priority must be 1-D [S] for keep_mask, got shape {priority_S.shape}")
    sinks, window, topk = validate_budget(sinks, window, topk)
    rank_S = token_ranks(priority_S)
    cutoff_S = cutoffs_from_ranks(rank_S, sinks=sinks, window=window, topk=topk)
    return keep_mask_from_compact(rank_S, cutoff_S, sinks, window)


def keep_mask_heads(prio_BKS, *, sinks: int, window: int, topk):
    """:func:`keep_mask` for every head at once: ``bool [B, K, S, S]`` from ``prio [B, K, S]``;
    ``topk`` an int or per-head budgets broadcastable to ``[B, K]``."""
    ranks = token_ranks(prio_BKS)                                                        # [B, K, S]
    cut = cutoffs_from_ranks(ranks, sinks=sinks, window=window, topk=topk)               # [B, K, S]
    return keep_mask_from_compact(ranks, cut, sinks, window)


def keep_mask_from_compact(rank_XS, cutoff_XS, sinks: int, window: int) -> jax.Array:
    """Dense mask ``bool [..., S, S]`` from ``rank`` and ``cutoff`` ``[..., S]``."""
    sinks = validate_size("sinks", sinks, 0)
    window = validate_size("window", window, 1)
    rank_XS, cutoff_XS = validate_tokens("rank", rank_XS), validate_tokens("cutoff", cutoff_XS)
    if rank_XS.shape != cutoff_XS.shape:
        raise ValueError(f"rank and cutoff must have the same shape, got {rank_XS.shape} and {cutoff_XS.shape}")
    return dense_keep_mask(rank_XS, cutoff_XS, sinks, window)


def compact_keep(
    priority_XS, *, sinks: int, window: int, topk: int, block_q: int = 128, block_k: int = 128
) -> CompactKeep:
    """Compact keep rule for ``priority [..., S]`` with ``block_q x block_k`` tiles."""
    sinks, window, topk = validate_budget(sinks, window, topk)
    block_q, block_k = validate_size("block_q", block_q, 1), validate_size("block_k", block_k, 1)
    rank_XS = token_ranks(priority_XS)
    cutoff_XS = cutoffs_from_ranks(rank_XS, sinks=sinks, window=window, topk=topk)
    blocks = block_any_kept(rank_XS, cutoff_XS, sinks=sinks, window=window, block_q=block_q, block_k=block_k)
    return CompactKeep(rank_XS, cutoff_XS, blocks)
