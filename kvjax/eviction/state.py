"""The bounded KV cache of one layer: a pure pytree, ``prefill`` and ``append``.

Per batch row and KV head it holds ``s`` sink slots (positions ``0..s-1``), a ring of
the ``w`` most recent non-sink tokens (slot ``p mod w``), and ``m = k_max`` long-range
slots with their static priorities and original positions (``-1`` = empty), of which
head ``h`` may fill ``budget[b, h] <= m``. Memory is ``s + w + m`` slots whatever the
length. Keys are stored post-RoPE at their original positions.

Keep rule (DESIGN.md): at query ``q`` the long-range slots hold the ``min(k, |E(q)|)``
tokens of ``E(q) = {t : s <= t <= q - w}`` with the highest priority, ties to the more
recent token. ``append`` keeps this online: the token ``t = q - w`` leaving the window
replaces the lowest-priority slot (oldest among equals) when ``p_t >= min``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.eviction.config import EvictionConfig


@struct.dataclass
class LayerState:
    sink_k: jax.Array      # [B, K, s, D]
    sink_v: jax.Array
    win_k: jax.Array       # [B, K, w, D], slot = position mod w
    win_v: jax.Array
    lr_k: jax.Array        # [B, K, m, D]
    lr_v: jax.Array
    lr_pos: jax.Array      # [B, K, m] int32, -1 = empty
    lr_prio: jax.Array     # [B, K, m] float32
    sink_score: jax.Array  # [B, K, s] float32 - policy statistics (attention received)
    win_score: jax.Array   # [B, K, w]
    lr_score: jax.Array    # [B, K, m]
    win_prio: jax.Array    # [B, K, w] float32 - ring tokens' priority snapshot (SnapKV)
    budget: jax.Array      # [B, K] int32, long-range slots this head may fill (<= m)


def init_layer(ev: EvictionConfig, batch: int, kv_heads: int, head_dim: int, dtype, budget=None) -> LayerState:
    s, w, m = ev.sinks, ev.window, ev.slots
    z = lambda n: jnp.zeros((batch, kv_heads, n, head_dim), dtype)  # noqa: E731
    f = lambda n: jnp.zeros((batch, kv_heads, n), jnp.float32)  # noqa: E731
    if budget is None:
        budget = jnp.full((batch, kv_heads), ev.topk, jnp.int32)
    return LayerState(z(s), z(s), z(w), z(w), z(m), z(m), jnp.full((batch, kv_heads, m), -1, jnp.int32),
                      f(m), f(s), f(w), f(m), f(w), jnp.asarray(budget, jnp.int32))


def window_positions(q_B, ev: EvictionConfig):
    """Position held by each ring slot after query ``q``: ``[B, w]`` int32, -1 if none."""
    j = jnp.arange(ev.window)[None, :]
    q = q_B[:, None]
    p = q - jnp.mod(q - j, ev.window)
    return jnp.where((p >= ev.sinks) & (p >= 0), p, -1)


def sink_positions(q_B, ev: EvictionConfig):
    """``[B, s]`` int32 sink positions present after query ``q``, -1 if not yet seen."""
    j = jnp.arange(ev.sinks)[None, :]
    return jnp.where(j <= q_B[:, None], j, -1)


def slot_positions(st: LayerState, q_B, ev: EvictionConfig):
    """``[B, K, s + w + m]`` positions of all slots (sinks, ring, long-range), -1 = empty."""
    B, K = st.lr_pos.shape[:2]
    sp = jnp.broadcast_to(sink_positions(q_B, ev)[:, None], (B, K, ev.sinks))
    wp = jnp.broadcast_to(window_positions(q_B, ev)[:, None], (B, K, ev.window))
    return jnp.concatenate([sp, wp, st.lr_pos], axis=-1)


def _take_positions(x_BSKD, pos_BKN):
    """Gather ``x[b, pos[b, h, n], h]`` -> ``[B, K, N, D]`` (clipped; callers mask invalid)."""
    S = x_BSKD.shape[1]
    x_BKSD = jnp.swapaxes(x_BSKD, 1, 2)
    idx = jnp.clip(pos_BKN, 0, S - 1)[..., None]
    return jnp.take_along_axis(x_BKSD, idx, axis=2)


def select_top(prio_BKS, eligible_BKS, count_BK, m: int):
    """Indices ``[B, K, m]`` of the ``count`` best eligible tokens (priority desc, then
    position desc) and their validity."""
    S = prio_BKS.shape[-1]
    pos = jnp.broadcast_to(jnp.arange(S), prio_BKS.shape)
    key_p = jnp.where(eligible_BKS, -prio_BKS, jnp.inf)
    order = jnp.lexsort((-pos, key_p), axis=-1)   # primary: -prio (asc); secondary: -pos
    if S < m:
        order = jnp.concatenate([order, jnp.zeros(order.shape[:-1] + (m - S,), order.dtype)], -1)
    order = order[..., :m]
    valid = jnp.arange(m) < count_BK[..., None]
    return order, valid


def prefill_layer(st: LayerState, k_BSKD, v_BSKD, prio_BKS, score_BKS, lengths_B, ev: EvictionConfig) -> LayerState:
    """State after the prompt (row ``b`` has ``lengths[b]`` real tokens): row ``n - 1`` of the keep rule."""
    B, S, K, D = k_BSKD.shape
    q_B = lengths_B - 1
    sp = jnp.broadcast_to(sink_positions(q_B, ev)[:, None], (B, K, ev.sinks))
    wp = jnp.broadcast_to(window_positions(q_B, ev)[:, None], (B, K, ev.window))
    t = jnp.arange(S)[None, None, :]
    eligible = (t >= ev.sinks) & (t <= (q_B - ev.window)[:, None, None])
    n_elig = jnp.sum(eligible, axis=-1)
    idx, valid = select_top(prio_BKS, eligible, jnp.minimum(st.budget, n_elig), ev.slots)
    lp = jnp.where(valid, idx, -1).astype(jnp.int32)

    def fill(x, pos):
        g = _take_positions(x, pos).astype(st.sink_k.dtype)
        return jnp.where((pos >= 0)[..., None], g, 0)

    def gather_s(x_BKS, pos):
        g = jnp.take_along_axis(x_BKS, jnp.clip(pos, 0, S - 1), axis=-1)
        return jnp.where(pos >= 0, g, 0.0)

    return st.replace(
        sink_k=fill(k_BSKD, sp), sink_v=fill(v_BSKD, sp), win_k=fill(k_BSKD, wp), win_v=fill(v_BSKD, wp),
        lr_k=fill(k_BSKD, lp), lr_v=fill(v_BSKD, lp), lr_pos=lp,
        lr_prio=gather_s(prio_BKS.astype(jnp.float32), lp), win_prio=gather_s(prio_BKS.astype(jnp.float32), wp),
        sink_score=gather_s(score_BKS, sp), win_score=gather_s(score_BKS, wp), lr_score=gather_s(score_BKS, lp))


def exiting(st: LayerState, q_B, ev: EvictionConfig):
    """The token leaving the window at query ``q``:
    ``(k, v [B, K, D], t [B], valid [B], score [B, K], snapshot priority [B, K])``."""
    t = q_B - ev.window
    valid = t >= ev.sinks
    j = jnp.mod(q_B, ev.window)
    pick = lambda x: jnp.take_along_axis(x, j[:, None, None, None], axis=2)[:, :, 0]  # noqa: E731
    pick_s = lambda x: jnp.take_along_axis(x, j[:, None, None], axis=2)[:, :, 0]  # noqa: E731
    return pick(st.win_k), pick(st.win_v), t, valid, pick_s(st.win_score), pick_s(st.win_prio)


def insert_long_range(st: LayerState, k_BKD, v_BKD, t_B, valid_B, prio_BK, score_BK) -> LayerState:
    """Offer token ``t`` to the long-range slots: fill an empty one within the head's
    budget, else replace the lowest priority (oldest among equals) if ``prio >= min``."""
    m = st.lr_pos.shape[-1]
    if m == 0:
        return st
    occupied = st.lr_pos >= 0
    count = jnp.sum(occupied, axis=-1)
    full = count >= st.budget
    min_p = jnp.min(jnp.where(occupied, st.lr_prio, jnp.inf), axis=-1)
    big = jnp.iinfo(jnp.int32).max
    victim = jnp.argmin(jnp.where(occupied & (st.lr_prio == min_p[..., None]), st.lr_pos, big), axis=-1)
    target = jnp.where(full, victim, count)
    do = valid_B[:, None] & (st.budget > 0) & (~full | (prio_BK >= min_p))
    hit = (jnp.arange(m) == target[..., None]) & do[..., None]       # [B, K, m]
    put = lambda old, new: jnp.where(hit[..., None], new[:, :, None].astype(old.dtype), old)  # noqa: E731
    put_s = lambda old, new: jnp.where(hit, new[..., None].astype(old.dtype), old)  # noqa: E731
    tt = jnp.broadcast_to(t_B[:, None], prio_BK.shape)
    return st.replace(lr_k=put(st.lr_k, k_BKD), lr_v=put(st.lr_v, v_BKD), lr_pos=put_s(st.lr_pos, tt),
                      lr_prio=put_s(st.lr_prio, prio_BK), lr_score=put_s(st.lr_score, score_BK))


def write_current(st: LayerState, k_BKD, v_BKD, q_B, ev: EvictionConfig) -> LayerState:
    """Store the token at position ``q`` in its sink slot (``q < s``) or ring slot ``q mod w``."""
    is_sink = q_B < ev.sinks
    hit_s = (jnp.arange(ev.sinks)[None, :] == q_B[:, None]) & is_sink[:, None]          # [B, s]
    hit_w = (jnp.arange(ev.window)[None, :] == jnp.mod(q_B, ev.window)[:, None]) & ~is_sink[:, None]
    put = lambda old, new, hit: jnp.where(hit[:, None, :, None], new[:, :, None].astype(old.dtype), old)  # noqa: E731
    return st.replace(sink_k=put(st.sink_k, k_BKD, hit_s), sink_v=put(st.sink_v, v_BKD, hit_s),
                      win_k=put(st.win_k, k_BKD, hit_w), win_v=put(st.win_v, v_BKD, hit_w),
                      sink_score=jnp.where(hit_s[:, None], 0.0, st.sink_score),
                      win_score=jnp.where(hit_w[:, None], 0.0, st.win_score),
                      win_prio=jnp.where(hit_w[:, None], 0.0, st.win_prio))


def all_slots(st: LayerState):
    """Keys, values ``[B, K, s + w + m, D]`` and scores ``[B, K, s + w + m]`` of every slot."""
    k = jnp.concatenate([st.sink_k, st.win_k, st.lr_k], axis=2)
    v = jnp.concatenate([st.sink_v, st.win_v, st.lr_v], axis=2)
    sc = jnp.concatenate([st.sink_score, st.win_score, st.lr_score], axis=2)
    return k, v, sc


def set_scores(st: LayerState, scores_BKN, ev: EvictionConfig) -> LayerState:
    s, w = ev.sinks, ev.window
    return st.replace(sink_score=scores_BKN[..., :s], win_score=scores_BKN[..., s:s + w],
                      lr_score=scores_BKN[..., s + w:])
