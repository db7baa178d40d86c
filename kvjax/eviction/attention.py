"""Attention under the keep rule (XLA, reference quality).

- ``keep_mask_heads``: the dense ``[B, K, S, S]`` keep rule from per-head priorities,
  via static ranks and Fenwick cutoffs (so training, prefill and decoding share it).
- ``masked_attention``: causal softmax attention restricted to a per-KV-head mask,
  returning the output and the per-query log-sum-exp (training and prefill path).
- ``slot_attention``: one decode step's attention over the bounded cache's slots,
  returning the output and each slot's probability per query head.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvjax.eviction.fenwick import cutoffs_from_ranks, token_ranks
from kvjax.eviction.keep_rule import keep_mask_from_compact
from pallas_kernels.reference import grouped_attention


def keep_mask_heads(prio_BKS, *, sinks: int, window: int, topk):
    """``bool [B, K, S, S]``: ``[.., q, t]`` true where query ``q`` may attend key ``t``;
    ``topk`` an int or per-head budgets broadcastable to ``[B, K]``."""
    ranks = token_ranks(prio_BKS)                                                        # [B, K, S]
    cut = cutoffs_from_ranks(ranks, sinks=sinks, window=window, topk=topk)               # [B, K, S]
    return keep_mask_from_compact(ranks, cut, sinks, window)


def masked_attention(q_BSHD, k_BSKD, v_BSKD, keep_BKSS, log_weights_BKSS=None):
    """``(out [B, S, H, D], lse [B, S, H])`` with keys restricted by ``keep`` per KV head;
    ``log_weights`` (optional) are added to the kept logits (LKV's multiplicative soft mask)."""
    out, lse, _ = grouped_attention(q_BSHD, k_BSKD, v_BSKD, allowed=keep_BKSS[:, :, None],
                                    log_weights=None if log_weights_BKSS is None else log_weights_BKSS[:, :, None])
    return out, lse


def causal_probs(q_BSHD, k_BSKD):
    """Dense causal attention probabilities ``[B, K, G, S, S]`` (float32), for heuristics."""
    S = q_BSHD.shape[1]
    causal = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]
    return grouped_attention(q_BSHD, k_BSKD, k_BSKD, allowed=causal)[2]


def slot_attention(q_BHD, k_BKND, v_BKND, valid_BKN):
    """``(out [B, H, D], probs [B, K, G, N])`` for one query per row over ``N`` slots."""
    out, _, p = grouped_attention(q_BHD[:, None], k_BKND, v_BKND, allowed=valid_BKN[:, :, None, None],
                                  kv_layout="BKTD")
    return out[:, 0], p[:, :, :, 0]
