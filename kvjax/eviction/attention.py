"""Attention under the keep rule (XLA, reference quality).

- ``masked_attention``: causal softmax attention restricted to a per-KV-head mask,
  returning the output and the per-query log-sum-exp (training and prefill path).
- ``statistic_probs``: the prefill's attention probabilities an attention statistic reads
  (all query rows, or only each row's last few); ``statistic_scores`` reduces them to the
  statistic, reading all rows a block at a time.
- ``slot_attention``: one decode step's attention over the bounded cache's slots,
  returning the output and each slot's probability per query head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import grouped_attention


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


def statistic_probs(q_BSHD, k_BSKD, lengths_B, rows: int | None):
    """``(probs [B, K, G, R, S], qpos [B, R])`` for an attention statistic: every query row
    (``rows=None``: :func:`causal_probs`, ``qpos = 0..S-1``), or only each row's last ``rows``
    real queries (``qpos = n_b - rows + r``; negative = no such query, its probabilities are
    garbage and the statistic must skip it). A row's probabilities do not depend on the other
    rows, so the selected rows equal those rows of :func:`causal_probs`."""
    B, S = q_BSHD.shape[:2]
    if rows is None:
        return causal_probs(q_BSHD, k_BSKD), jnp.broadcast_to(jnp.arange(S), (B, S))
    qpos = lengths_B[:, None] - rows + jnp.arange(rows)[None, :]                        # [B, R]
    q = jnp.take_along_axis(q_BSHD, jnp.clip(qpos, 0, S - 1)[:, :, None, None], axis=1)
    causal = (jnp.arange(S)[None, None, :] <= qpos[:, :, None])[:, None, None]            # [B, 1, 1, R, S]
    return grouped_attention(q, k_BSKD, k_BSKD, allowed=causal)[2], qpos


def statistic_scores(q_BSHD, k_BSKD, lengths_B, rows: int | None, scores_fn, *, block: int | None = None,
                     columnwise: bool = False):
    """``[B, K, S]``: ``scores_fn(probs [B, K, G, R, S], lengths_B, qpos [B, R])`` over the query
    rows a statistic reads (:func:`statistic_probs`). With ``rows=None`` (every row: H2O) the
    rows are read ``block`` at a time and the blocks' scores summed, so no ``[B, K, G, S, S]``
    array is formed; this needs ``scores_fn`` linear in the probabilities (sums over rows, a
    mean over the query group, pooling over positions: every statistic here is). Rows past the
    prompt's padding contribute zero probability.

    ``columnwise``: a key's score reads only its own column (no pooling over positions: H2O).
    Then query block ``[s0, e)`` reads only keys ``[0, e)`` (the later keys' probabilities are
    zero), about half the work: 1.14 -> 0.57 s a layer at 8 x 2k tokens on 2 CPU cores
    (``bench/statistic_speed.py``), blocks of 128 rows (256 without it)."""
    B, S = q_BSHD.shape[:2]
    block = block or (128 if columnwise else 256)
    if rows is not None or S <= block:
        probs, qpos = statistic_probs(q_BSHD, k_BSKD, lengths_B, rows)
        return scores_fn(probs, lengths_B, qpos)
    if columnwise:
        acc = jnp.zeros((B, k_BSKD.shape[2], S), jnp.float32)
        for s0 in range(0, S, block):
            e = min(S, s0 + block)
            qpos = jnp.broadcast_to(jnp.arange(s0, e), (B, e - s0))                        # [B, C]
            causal = (jnp.arange(e)[None, None, :] <= qpos[:, :, None])[:, None, None]    # [B, 1, 1, C, e]
            probs = grouped_attention(q_BSHD[:, s0:e], k_BSKD[:, :e], k_BSKD[:, :e], allowed=causal)[2]
            acc = acc.at[..., :e].add(scores_fn(probs, lengths_B, qpos))
        return acc
    nblk = -(-S // block)
    q = jnp.pad(q_BSHD, ((0, 0), (0, nblk * block - S), (0, 0), (0, 0)))
    t = jnp.arange(S)

    def body(acc_BKS, i):
        qpos = jnp.broadcast_to(i * block + jnp.arange(block), (B, block))                 # [B, C]
        qb = jax.lax.dynamic_slice_in_dim(q, i * block, block, axis=1)
        causal = (t[None, None, :] <= qpos[:, :, None])[:, None, None]                     # [B, 1, 1, C, S]
        probs = grouped_attention(qb, k_BSKD, k_BSKD, allowed=causal)[2]
        probs = jnp.where((qpos < S)[:, None, None, :, None], probs, 0.0)
        return acc_BKS + scores_fn(probs, lengths_B, qpos), None

    init = jnp.zeros((B, k_BSKD.shape[2], S), jnp.float32)
    return jax.lax.scan(body, init, jnp.arange(nblk))[0]


def slot_attention(q_BHD, k_BKND, v_BKND, valid_BKN):
    """``(out [B, H, D], probs [B, K, G, N])`` for one query per row over ``N`` slots."""
    out, _, p = grouped_attention(q_BHD[:, None], k_BKND, v_BKND, allowed=valid_BKN[:, :, None, None],
                                  kv_layout="BKTD")
    return out[:, 0], p[:, :, :, 0]
