"""Attention under the keep rule (XLA, reference quality).

- ``keep_mask_heads``: the dense ``[B, K, S, S]`` keep rule from per-head priorities,
  via static ranks and Fenwick cutoffs (so training, prefill and decoding share it).
- ``masked_attention``: causal softmax attention restricted to a per-KV-head mask,
  returning the output and the per-query log-sum-exp (training and prefill path).
- ``slot_attention``: one decode step's attention over the bounded cache's slots,
  returning the output and each slot's probability per query head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.eviction.fenwick import cutoffs_from_ranks, token_ranks
from kvjax.eviction.keep_rule import keep_mask_from_compact

NEG_INF = -1e30


def keep_mask_heads(prio_BKS, *, sinks: int, window: int, topk):
    """``bool [B, K, S, S]``: ``[.., q, t]`` true where query ``q`` may attend key ``t``;
    ``topk`` an int or per-head budgets broadcastable to ``[B, K]``."""
    ranks = token_ranks(prio_BKS)                                                        # [B, K, S]
    cut = cutoffs_from_ranks(ranks, sinks=sinks, window=window, topk=topk)               # [B, K, S]
    return keep_mask_from_compact(ranks, cut, sinks, window)


def masked_attention(q_BSHD, k_BSKD, v_BSKD, keep_BKSS, log_weights_BKSS=None):
    """``(out [B, S, H, D], lse [B, S, H])`` with keys restricted by ``keep`` per KV head;
    ``log_weights`` (optional) are added to the kept logits (LKV's multiplicative soft mask)."""
    B, S, H, D = q_BSHD.shape
    K = k_BSKD.shape[2]
    q = q_BSHD.reshape(B, S, K, H // K, D)
    logits = jnp.einsum("bskgd,btkd->bkgst", q, k_BSKD, preferred_element_type=jnp.float32) * D ** -0.5
    if log_weights_BKSS is not None:
        logits = logits + log_weights_BKSS[:, :, None]
    logits = jnp.where(keep_BKSS[:, :, None], logits, NEG_INF)
    lse = jax.nn.logsumexp(logits, axis=-1)                                     # [B, K, G, S]
    p = jnp.exp(logits - lse[..., None])
    out = jnp.einsum("bkgst,btkd->bskgd", p.astype(v_BSKD.dtype), v_BSKD, preferred_element_type=jnp.float32)
    lse_BSH = jnp.transpose(lse, (0, 3, 1, 2)).reshape(B, S, H)
    return out.reshape(B, S, H, D).astype(q_BSHD.dtype), lse_BSH


def causal_probs(q_BSHD, k_BSKD):
    """Dense causal attention probabilities ``[B, K, G, S, S]`` (float32), for heuristics."""
    B, S, H, D = q_BSHD.shape
    K = k_BSKD.shape[2]
    q = q_BSHD.reshape(B, S, K, H // K, D)
    logits = jnp.einsum("bskgd,btkd->bkgst", q, k_BSKD, preferred_element_type=jnp.float32) * D ** -0.5
    causal = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]
    return jax.nn.softmax(jnp.where(causal, logits, NEG_INF), axis=-1)


def slot_attention(q_BHD, k_BKND, v_BKND, valid_BKN):
    """``(out [B, H, D], probs [B, K, G, N])`` for one query per row over ``N`` slots."""
    B, H, D = q_BHD.shape
    K = k_BKND.shape[1]
    q = q_BHD.reshape(B, K, H // K, D)
    logits = jnp.einsum("bkgd,bknd->bkgn", q, k_BKND, preferred_element_type=jnp.float32) * D ** -0.5
    logits = jnp.where(valid_BKN[:, :, None], logits, NEG_INF)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgn,bknd->bkgd", p.astype(v_BKND.dtype), v_BKND, preferred_element_type=jnp.float32)
    return out.reshape(B, H, D).astype(q_BHD.dtype), p
