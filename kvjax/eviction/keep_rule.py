"""The keep rule: which keys each query may attend (DESIGN.md, "The keep rule").

Per row with budget ``(s, w, k)``, query ``q`` attends key ``t <= q`` iff

    t < s                                   (sink)
    or q - w < t                            (protected window)
    or s <= t <= q - w and rank(t) <= tau_q (kept long-range, see ``fenwick``).

Two forms: the dense ``bool [S, S]`` mask (``keep_mask``) and the compact one
kernels use (``CompactKeep``: per-token ranks, per-query cutoffs, and which
``(query block, key block)`` tiles hold any kept key).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

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


def static_priority(scores_XS, decay_lambda_X) -> jax.Array:
    """``p_t = r_t + lambda * t``: ranking by ``p`` equals ranking by the decayed
    score ``r_t - lambda (q - t)`` at every ``q``. ``scores [..., S]``, ``decay_lambda``
    broadcastable to ``[...]`` (e.g. one per head) -> ``[..., S]``."""
    scores_XS = jnp.asarray(scores_XS)
    position_S = jnp.arange(scores_XS.shape[-1], dtype=scores_XS.dtype)
    return scores_XS + jnp.asarray(decay_lambda_X, scores_XS.dtype)[..., None] * position_S


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


def keep_mask_from_compact(rank_XS, cutoff_XS, sinks: int, window: int) -> jax.Array:
    """Dense mask ``bool [..., S, S]`` from ``rank`` and ``cutoff`` ``[..., S]``."""
    sinks = validate_size("sinks", sinks, 0)
    window = validate_size("window", window, 1)
    rank_XS, cutoff_XS = validate_tokens("rank", rank_XS), validate_tokens("cutoff", cutoff_XS)
    if rank_XS.shape != cutoff_XS.shape:
        raise ValueError(f"rank and cutoff must have the same shape, got {rank_XS.shape} and {cutoff_XS.shape}")
    S = rank_XS.shape[-1]
    return _dense_keep(rank_XS, cutoff_XS, min(sinks, S + 1), min(window, S + 1))  # larger values act alike


@jax.jit
def _dense_keep(rank_XS, cutoff_XS, sinks, window):
    S = rank_XS.shape[-1]
    q_Q1 = jnp.arange(S)[:, None]
    t_1T = jnp.arange(S)[None, :]
    eligible_QT = (t_1T >= sinks) & (t_1T <= q_Q1 - window)
    kept_XQT = eligible_QT & (rank_XS[..., None, :] <= cutoff_XS[..., :, None])
    return (t_1T <= q_Q1) & ((t_1T < sinks) | (t_1T > q_Q1 - window) | kept_XQT)


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


def block_any_kept(rank_XS, cutoff_XS, *, sinks: int, window: int, block_q: int, block_k: int) -> jax.Array:
    """``bool [..., nq, nk]``: query block ``i`` keeps some key of key block ``j`` (the kernels'
    block-skip map), from ``rank`` and ``cutoff`` ``[..., S]``, without the ``S x S`` mask."""
    S = rank_XS.shape[-1]
    blocks = _block_any_kept(rank_XS.reshape(-1, S), cutoff_XS.reshape(-1, S), min(sinks, S + 1),
                             min(window, S + 1), block_q, block_k)
    return blocks.reshape(*rank_XS.shape[:-1], *blocks.shape[1:])


@functools.partial(jax.jit, static_argnums=(4, 5))
def _block_any_kept(rank_HS, cutoff_HS, sinks, window, block_q, block_k):
    """``bool [H, nq, nk]`` for rows ``[H, S]``."""
    row = functools.partial(_row_block_any_kept, sinks=sinks, window=window, block_q=block_q, block_k=block_k)
    return jax.vmap(row)(rank_HS, cutoff_HS)


def _row_block_any_kept(rank_S, cutoff_S, *, sinks, window, block_q, block_k):
    """``bool [nq, nk]`` for one row, without the ``S x S`` mask. Sinks and the window are
    intervals per query block. A long-range token ``t`` is kept for the queries
    ``t + w <= q <= e_t``, where ``e_t + 1 = #{q : tau_q >= rank(t)}`` because
    ``tau`` is non-increasing; these intervals mark tiles via a difference array."""
    S = rank_S.shape[0]
    nq, nk = -(-S // block_q), -(-S // block_k)
    q_start_Q1 = (jnp.arange(nq) * block_q)[:, None]
    q_end_Q1 = jnp.minimum(q_start_Q1 + block_q, S) - 1
    k_start_1K = (jnp.arange(nk) * block_k)[None, :]
    k_end_1K = jnp.minimum(k_start_1K + block_k, S) - 1
    sink_QK = (k_start_1K < sinks) & (k_start_1K <= q_end_Q1)
    window_QK = (k_start_1K <= q_end_Q1) & (k_end_1K > q_start_Q1 - window)

    t_S = jnp.arange(S)
    first_q_S = t_S + window
    last_q_S = jnp.searchsorted(-cutoff_S, -rank_S, side="right") - 1
    live_S = (t_S >= sinks) & (first_q_S <= last_q_S)
    key_block_S = t_S // block_k
    marks_KQ = jnp.zeros((nk, nq + 1), jnp.int32)
    marks_KQ = marks_KQ.at[key_block_S, jnp.where(live_S, first_q_S // block_q, nq)].add(1)
    marks_KQ = marks_KQ.at[key_block_S, jnp.where(live_S, last_q_S // block_q + 1, nq)].add(-1)
    long_QK = (jnp.cumsum(marks_KQ, axis=1)[:, :nq] > 0).T
    return sink_QK | window_QK | long_QK
