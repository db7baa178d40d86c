"""The bounded KV cache of one layer: one slot buffer, filled at prefill and updated in place.

Per batch row and KV head the buffer has ``N = s + w + m`` slots (``m = k_max``): keys and
values ``[B, K, N, D]`` (post-RoPE, at their original positions) and two small side arrays,
``pos [B, K, N]`` (a slot's original position, ``-1`` = empty) and ``prio [B, K, N]`` (its
priority as a long-range candidate). Which slot holds which token does not matter: a slot
is a sink, a window or a long-range slot by its position alone, so a decode step writes
exactly one slot per head and nothing moves.

Keep rule (docs/design.md, "The keep rule"): at query ``q`` the cache holds the sinks ``t < s``, the window
``q - w < t <= q`` and the ``min(b, |E(q)|)`` tokens of ``E(q) = {t : s <= t <= q - w}``
with the highest priority, ties to the more recent token (``b <= m`` the head's budget).
When token ``q`` arrives, the token ``t = q - w`` leaves the window and joins ``E(q)``:

- if the head holds fewer than ``b`` long-range tokens, ``t`` stays and ``q`` takes an
  empty slot;
- else if ``p_t >=`` the lowest long-range priority, ``t`` stays and ``q`` takes the slot of
  the lowest-priority long-range token (the oldest among equals), which is evicted;
- else ``t`` is evicted and ``q`` takes its slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.eviction.config import EvictionConfig


@struct.dataclass
class SlotBuffer:
    k: jax.Array        # [B, K, N, D]
    v: jax.Array        # [B, K, N, D]
    pos: jax.Array      # [B, K, N] int32, -1 = empty
    prio: jax.Array     # [B, K, N] float32, long-range priority (meaningful once a token left the window)
    budget: jax.Array   # [B, K] int32, long-range tokens this head may hold (<= m)

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def init_buffer(ev: EvictionConfig, batch: int, kv_heads: int, head_dim: int, dtype, budget=None) -> SlotBuffer:
    """An empty buffer of ``s + w + k_max`` slots per head; ``budget`` ``[B, K]`` (default ``topk``)."""
    n = ev.sinks + ev.window + ev.slots
    if budget is None:
        budget = jnp.full((batch, kv_heads), ev.topk, jnp.int32)
    z = lambda: jnp.zeros((batch, kv_heads, n, head_dim), dtype)  # noqa: E731  (two buffers: both are donated)
    return SlotBuffer(z(), z(), jnp.full((batch, kv_heads, n), -1, jnp.int32),
                      jnp.zeros((batch, kv_heads, n), jnp.float32), jnp.asarray(budget, jnp.int32))


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


def prefill_positions(budget_BK, prio_BKS, lengths_B, ev: EvictionConfig):
    """``int32 [B, K, N]``: the positions the buffer holds after the prompt (row ``b`` has
    ``lengths[b]`` real tokens), laid out as sinks, window (slot ``s + p mod w``), long range."""
    B, K, S = prio_BKS.shape
    q = (lengths_B - 1)[:, None]
    j = jnp.arange(ev.sinks)[None, :]
    sp = jnp.where(j <= q, j, -1)
    j = jnp.arange(ev.window)[None, :]
    p = q - jnp.mod(q - j, ev.window)
    wp = jnp.where((p >= ev.sinks) & (p >= 0), p, -1)
    t = jnp.arange(S)[None, None, :]
    eligible = (t >= ev.sinks) & (t <= (q - ev.window)[:, :, None])
    idx, valid = select_top(prio_BKS, eligible, jnp.minimum(budget_BK, jnp.sum(eligible, axis=-1)), ev.slots)
    lp = jnp.where(valid, idx, -1).astype(jnp.int32)
    head = lambda x: jnp.broadcast_to(x[:, None], (B, K, x.shape[-1]))  # noqa: E731
    return jnp.concatenate([head(sp), head(wp), lp], axis=-1)


def gather_tokens(x_BKS, pos_BKN, fill=0.0):
    """``x[b, h, pos[b, h, n]]`` ``[B, K, N]``, ``fill`` where ``pos < 0``."""
    g = jnp.take_along_axis(x_BKS, jnp.clip(pos_BKN, 0, x_BKS.shape[-1] - 1), axis=-1)
    return jnp.where(pos_BKN >= 0, g, fill)


def prefill_buffer(buf: SlotBuffer, k_BSKD, v_BSKD, prio_BKS, lengths_B, ev: EvictionConfig) -> SlotBuffer:
    """The buffer after the prompt: row ``n - 1`` of the keep rule, priorities gathered."""
    pos = prefill_positions(buf.budget, prio_BKS, lengths_B, ev)
    S = k_BSKD.shape[1]

    def fill(x_BSKD):
        g = jnp.take_along_axis(jnp.swapaxes(x_BSKD, 1, 2), jnp.clip(pos, 0, S - 1)[..., None], axis=2)
        return jnp.where((pos >= 0)[..., None], g, 0).astype(buf.k.dtype)

    return buf.replace(k=fill(k_BSKD), v=fill(v_BSKD), pos=pos, prio=gather_tokens(prio_BKS.astype(jnp.float32), pos))


def exiting_slot(buf: SlotBuffer, q_B, ev: EvictionConfig):
    """The token leaving the window when query ``q`` arrives (``t = q - w``):
    ``(slot int32 [B, K], present bool [B, K])``."""
    t = (q_B - ev.window)[:, None, None]
    here = (buf.pos == t) & (t >= ev.sinks)
    return jnp.argmax(here, axis=-1).astype(jnp.int32), jnp.any(here, axis=-1)


def read_slot(x_BKND, slot_BK):
    """``x[b, h, slot[b, h]]`` -> ``[B, K, D]``."""
    return jnp.take_along_axis(x_BKND, slot_BK[:, :, None, None], axis=2)[:, :, 0]


def read_side(x_BKN, slot_BK):
    """``x[b, h, slot[b, h]]`` of a side array -> ``[B, K]``."""
    return jnp.take_along_axis(x_BKN, slot_BK[..., None], axis=-1)[..., 0]


def put_side(x_BKN, slot_BK, new_BK):
    """``x`` with ``x[b, h, slot[b, h]] = new[b, h]`` (in place under jit)."""
    B, K = slot_BK.shape
    return x_BKN.at[jnp.arange(B)[:, None], jnp.arange(K)[None, :], slot_BK].set(new_BK.astype(x_BKN.dtype))


def place(buf: SlotBuffer, q_B, exit_slot_BK, exit_present_BK, exit_prio_BK, ev: EvictionConfig):
    """The module docstring's rule: ``(buffer with the exiting token's priority set,
    slot int32 [B, K] where token q goes)``. Long-range slots are ranked by ``buf.prio``."""
    t = (q_B - ev.window)[:, None, None]
    lr = (buf.pos >= ev.sinks) & (buf.pos < t)                     # long range before this step
    count = jnp.sum(lr, axis=-1)
    full = count >= buf.budget
    min_p = jnp.min(jnp.where(lr, buf.prio, jnp.inf), axis=-1)
    big = jnp.iinfo(jnp.int32).max
    victim = jnp.argmin(jnp.where(lr & (buf.prio == min_p[..., None]), buf.pos, big), axis=-1)
    empty = jnp.argmax(buf.pos < 0, axis=-1)
    stays = exit_present_BK & (buf.budget > 0) & (~full | (exit_prio_BK >= min_p))
    slot = jnp.where(exit_present_BK & ~stays, exit_slot_BK, jnp.where(stays & full, victim, empty)).astype(jnp.int32)
    prio = jnp.where(exit_present_BK, exit_prio_BK, read_side(buf.prio, exit_slot_BK))
    return buf.replace(prio=put_side(buf.prio, exit_slot_BK, prio)), slot


def write(buf: SlotBuffer, slot_BK, k_BKD, v_BKD, q_B) -> SlotBuffer:
    """Token ``q`` into ``slot`` of every head, in place (priority 0 until it leaves the window)."""
    B, K = slot_BK.shape
    b, h = jnp.arange(B)[:, None], jnp.arange(K)[None, :]
    return buf.replace(k=buf.k.at[b, h, slot_BK].set(k_BKD.astype(buf.k.dtype)),
                       v=buf.v.at[b, h, slot_BK].set(v_BKD.astype(buf.v.dtype)),
                       pos=put_side(buf.pos, slot_BK, jnp.broadcast_to(q_B[:, None], (B, K))),
                       prio=put_side(buf.prio, slot_BK, jnp.zeros((B, K))))


def long_range_positions(buf: SlotBuffer, q_B, ev: EvictionConfig):
    """``int32 [B, K, N]``: positions of the long-range tokens held after query ``q``, -1 elsewhere."""
    lr = (buf.pos >= ev.sinks) & (buf.pos <= (q_B - ev.window)[:, None, None])
    return jnp.where(lr, buf.pos, -1)


@struct.dataclass
class BoundedCache:
    layers: tuple[SlotBuffer, ...]
    lengths: jax.Array           # [B] prompt lengths (read by prefill)
    policy_state: tuple = ()     # per layer: the policy's own state (e.g. the mLSTM scorer's memory)

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))
