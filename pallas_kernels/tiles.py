"""Tile math shared by the TPU and GPU kernels (pure ``jnp`` on loaded blocks).

Dimension letters: G query heads per KV head, Q queries of a tile, T keys of a tile,
D head dim. Positions are absolute token indices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e30  # finite "minus infinity": masked logits, initial running max


def keep_tile(q0, t0, rank_1T, cut_Q1, *, sinks: int, window: int, Q: int, T: int):
    """``bool [Q, T]``: the keep rule for queries ``q0 + [0, Q)`` and keys ``t0 + [0, T)``.

    ``t <= q and (t < sinks or t > q - window or rank(t) <= cutoff(q))``; outside the
    long-range range ``[sinks, q - window]`` the rank test is never needed, and inside it
    ``rank <= cutoff`` is exactly membership in the top-``k`` (``kvjax.eviction.keep_rule``).
    """
    q_QT = q0 + jax.lax.broadcasted_iota(jnp.int32, (Q, T), 0)
    t_QT = t0 + jax.lax.broadcasted_iota(jnp.int32, (Q, T), 1)
    kept_QT = (t_QT < sinks) | (t_QT > q_QT - window) | (rank_1T <= cut_Q1)
    return (t_QT <= q_QT) & kept_QT


def grouped_keep(q0, t0, rank_1T, cut_Q1, *, sinks: int, window: int, Q: int, T: int, G: int):
    """``keep_tile`` repeated for the ``G`` query heads of a KV head: ``bool [G * Q, T]``."""
    keep = keep_tile(q0, t0, rank_1T, cut_Q1, sinks=sinks, window=window, Q=Q, T=T)
    return jnp.broadcast_to(keep[None], (G, Q, T)).reshape(G * Q, T)


def backward_tile(q_RD, do_RD, k_TD, v_TD, keep_RT, lse_R1, delta_R1, scale: float):
    """Flash-attention backward on one tile from the saved LSE: ``p = exp(s - lse)`` on kept
    entries and ``ds = p (do . v - delta)`` with ``delta = rowsum(do * o)`` (minus the LSE's
    cotangent): both ``float32 [R, T]``."""
    p = jnp.where(keep_RT, jnp.exp(logits(q_RD, k_TD, scale) - lse_R1), 0.0)
    return p, p * (logits(do_RD, v_TD, 1.0) - delta_R1)


def transposed_dot(a_RT, b_RD):
    """``a^T b``: ``float32 [T, D]`` (dk, dv accumulation)."""
    return jax.lax.dot_general(a_RT.astype(b_RD.dtype), b_RD, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def online_softmax_step(m_R1, l_R1, acc_RD, s_RT, keep_RT, v_TD):
    """One flash-attention step over a key tile for rows ``R``: running max ``m``, sum ``l``
    and unnormalised output ``acc`` (all float32)."""
    s_RT = jnp.where(keep_RT, s_RT, NEG)
    m_new = jnp.maximum(m_R1, jnp.max(s_RT, axis=-1, keepdims=True))
    p_RT = jnp.where(keep_RT, jnp.exp(s_RT - m_new), 0.0)
    alpha = jnp.exp(m_R1 - m_new)
    l_new = alpha * l_R1 + jnp.sum(p_RT, axis=-1, keepdims=True)
    acc_new = alpha * acc_RD + jnp.dot(p_RT.astype(v_TD.dtype), v_TD, preferred_element_type=jnp.float32)
    return m_new, l_new, acc_new


def logits(q_RD, k_TD, scale: float):
    """``float32 [R, T]`` scaled logits of a query tile against a key tile."""
    return jax.lax.dot_general(q_RD, k_TD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale


def finish_target(mass_GT, t0, *, S: int, window: int, aggregate: str, eps: float, T: int):
    """``float32 [1, T]`` log future mass from per-head sums ``sum_{d >= t + w} p(d -> t)``:
    count normalisation ``N_t = max(1, S - t - w)``, group aggregation, ``-inf`` without a future query."""
    t_1T = t0 + jax.lax.broadcasted_iota(jnp.int32, (1, T), 1)
    log_n = jnp.log(jnp.maximum(1, S - (t_1T + window)).astype(jnp.float32))
    log_m_GT = jnp.log(mass_GT) - log_n
    if aggregate == "max":
        agg = jnp.max(log_m_GT, axis=0, keepdims=True)
    else:
        top = jnp.maximum(jnp.max(log_m_GT, axis=0, keepdims=True), NEG)
        agg = top + jnp.log(jnp.mean(jnp.exp(log_m_GT - top), axis=0, keepdims=True))
    out = jnp.logaddexp(agg, jnp.log(jnp.float32(eps)))
    return jnp.where(t_1T + window < S, out, -jnp.inf)


def decode_kernel(q_ref, k_ref, v_ref, valid_ref, o_ref, lse_ref, *, scale: float):
    """One decode step over a chunk of slots, for all ``G`` query heads of a KV head:
    normalised partial output ``[G, D]`` and its log-sum-exp ``[G, 1]`` (``NEG`` if the
    chunk holds no valid slot), merged across chunks by the op API."""
    q = q_ref[...]
    s = logits(q, k_ref[...], scale)
    keep = jnp.broadcast_to(valid_ref[...] != 0, s.shape)
    G = q.shape[0]
    m, l, acc = online_softmax_step(jnp.full((G, 1), NEG, jnp.float32), jnp.zeros((G, 1), jnp.float32),
                                    jnp.zeros(q.shape, jnp.float32), s, keep, v_ref[...])
    l = jnp.maximum(l, 1e-30)
    o_ref[...] = (acc / l).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(m > NEG / 2, m + jnp.log(l), NEG).reshape(lse_ref.shape)
