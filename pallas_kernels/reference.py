"""XLA references of the three ops: the ground truth every kernel is tested against, and
the CPU path of ``backend="auto"``.

Layouts (the op API's): ``q [B, S, H, D]``, ``k, v [B, S, K, D]`` with ``H = G K``;
``rank, cutoff [B, K, S]`` from :func:`kvjax.eviction.keep_rule.compact_keep`.
"""

from __future__ import annotations

from kvjax.eviction.attention import masked_attention, slot_attention
from kvjax.eviction.keep_rule import keep_mask_from_compact
from kvjax.targets import future_attention_target


def sparse_attention(q_BSHD, k_BSKD, v_BSKD, rank_BKS, cutoff_BKS, *, sinks: int, window: int):
    """``(out [B, S, H, D], lse [B, S, H] float32)``: causal attention under the keep rule."""
    keep_BKSS = keep_mask_from_compact(rank_BKS, cutoff_BKS, sinks, window)
    return masked_attention(q_BSHD, k_BSKD, v_BSKD, keep_BKSS)


def transposed_target(q_BSHD, k_BSKD, lse_BSH, *, window: int, aggregate: str = "max"):
    """``float32 [B, K, S]`` log future-attention mass (``-inf`` where no query is ``>= t + w``)."""
    return future_attention_target(q_BSHD, k_BSKD, window=window, lse=lse_BSH, aggregate=aggregate)


def sparse_decode(q_BHD, k_BKND, v_BKND, valid_BKN):
    """One decode step over the bounded cache's slots: ``out [B, H, D]`` (``lse`` dropped)."""
    out, _ = slot_attention(q_BHD, k_BKND, v_BKND, valid_BKN)
    return out

