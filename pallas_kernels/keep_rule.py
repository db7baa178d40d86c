"""The keep rule in the compact form the kernels read (self-contained: no ``kvjax`` import).

Per row with sinks ``s`` and window ``w``, query ``q`` attends key ``t <= q`` iff
``t < s``, or ``q - w < t``, or ``s <= t <= q - w`` and ``rank(t) <= cutoff(q)``
(``rank`` 0 = best token, ``cutoff`` the running top-k threshold; both ``[..., S]``).

- :func:`dense_keep_mask`: the ``bool [..., S, S]`` mask (the references' ground truth).
- :func:`block_any_kept`: the kernels' block-skip map, without the ``S x S`` mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def dense_keep_mask(rank_XS, cutoff_XS, sinks: int, window: int, *, first_row: int = 0) -> jax.Array:
    """``bool [..., Q, T]``: ``[.., q, t]`` true where query ``first_row + q`` keeps key ``t``.

    ``rank [..., T]`` of keys ``0..T-1``; ``cutoff [..., Q]`` of queries ``first_row..first_row + Q - 1``
    (by default every query of the sequence: ``Q = T``, an ``S x S`` mask)."""
    T = rank_XS.shape[-1]
    return _dense_keep(rank_XS, cutoff_XS, min(int(sinks), T + 1), min(int(window), T + 1),  # larger values act alike
                       first_row=int(first_row))


@functools.partial(jax.jit, static_argnames=("first_row",))
def _dense_keep(rank_XS, cutoff_XS, sinks, window, *, first_row: int):
    q_Q1 = first_row + jnp.arange(cutoff_XS.shape[-1])[:, None]
    t_1T = jnp.arange(rank_XS.shape[-1])[None, :]
    eligible_QT = (t_1T >= sinks) & (t_1T <= q_Q1 - window)
    kept_XQT = eligible_QT & (rank_XS[..., None, :] <= cutoff_XS[..., :, None])
    return (t_1T <= q_Q1) & ((t_1T < sinks) | (t_1T > q_Q1 - window) | kept_XQT)


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
