"""The prefill-compressed caches (:mod:`kvjax.eviction.prompt_compressed`).

- :class:`CompressedCache`: the dense cache with a per-head visibility mask, so outputs equal
  those of a cache that dropped the evicted entries (slot ``t`` = position ``t``);
- :class:`CompactCache`: that cache with the evicted entries dropped (what kvpress's pruned
  cache holds): each row and KV head's kept context gathered, in position order, into slots
  ``[0, M)``, the tokens after the context from slot ``M`` on. A decode step reads
  ``M + R`` slots instead of ``T``; the attention outputs are the same (the kept keys carry
  their RoPE positions, applied before caching).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.cache.dense import DenseCache, dense_cache_attention
from kvjax.sampling import bucket


@struct.dataclass
class CompressedCache:
    dense: DenseCache
    keep: tuple[jax.Array, ...]   # per layer bool [B, K, T]: slot visible to later queries
    budgets: jax.Array            # int32 [L, B, K]: the ranker's long-range budget per head (at its topk)
    policy_state: tuple = ()      # a static ranker's per-layer state (the mLSTM's memory)


@struct.dataclass
class CompactCache:
    dense: DenseCache                # per layer [B, K, M + R, D]
    visible: tuple[jax.Array, ...]   # per layer bool [B, K, M + R]: kept context slots and every slot >= M
    shift: jax.Array                 # int32 [B]: the token at position p (past the context) sits in slot p - shift_b
    extra: int = struct.field(pytree_node=False, default=0)   # R: slots for the question and new tokens


def kept_context(cache: CompressedCache, context_B) -> int:
    """The most context tokens any row, layer and KV head of ``cache`` keeps (a host int)."""
    T = cache.keep[0].shape[-1]
    ctx = np.arange(T)[None, None, :] < np.asarray(context_B)[:, None, None]
    return max(int((np.asarray(k) & ctx).sum(-1).max()) for k in cache.keep)


@functools.partial(jax.jit, static_argnames=("slots", "extra"))
def _compact(cache: CompressedCache, context_B, *, slots: int, extra: int) -> CompactCache:
    T = cache.keep[0].shape[-1]
    in_context = jnp.arange(T)[None, None, :] < context_B[:, None, None]
    col = jnp.arange(slots + extra)[None, None, :]
    pad = ((0, 0), (0, 0), (0, extra), (0, 0))
    ks, vs, vis = [], [], []
    for k_BKTD, v_BKTD, keep_BKT in zip(cache.dense.k, cache.dense.v, cache.keep):
        kept = keep_BKT & in_context
        order = jnp.argsort(~kept, axis=-1, stable=True)[..., :slots]       # kept slots first, in position order
        ks.append(jnp.pad(jnp.take_along_axis(k_BKTD, order[..., None], axis=2), pad))
        vs.append(jnp.pad(jnp.take_along_axis(v_BKTD, order[..., None], axis=2), pad))
        vis.append((col < kept.sum(-1)[..., None]) | (col >= slots))
    return CompactCache(DenseCache(tuple(ks), tuple(vs)), tuple(vis), (context_B - slots).astype(jnp.int32),
                        extra=extra)


def compact(cache: CompressedCache, context_B, *, extra: int, slots: int | None = None,
            bucketed: bool = False) -> CompactCache:
    """``cache`` with its evicted context entries dropped: ``slots`` (default: :func:`kept_context`,
    rounded up by :func:`kvjax.sampling.bucket` when ``bucketed``, so a few compiled programs serve
    many batches) context slots per row and KV head, then ``extra`` empty slots for the tokens
    that follow the context (positions ``n_b ..``). ``slots`` must hold every head's kept context."""
    need = kept_context(cache, context_B)
    if slots is None:
        slots = min(bucket(need), cache.keep[0].shape[-1]) if bucketed else need
    slots = int(slots)
    if slots < need:
        raise ValueError(f"compact: slots={slots} cannot hold a head's {need} kept context tokens")
    if slots > cache.keep[0].shape[-1] or extra < 1:
        raise ValueError(f"compact: slots must be <= the cache's {cache.keep[0].shape[-1]} and extra >= 1, "
                         f"got slots={slots}, extra={extra}")
    return _compact(cache, jnp.asarray(context_B, jnp.int32), slots=slots, extra=int(extra))


def attend_compact(layer: int, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache: CompactCache):
    """Attention backend after the compaction: queries past the context (positions ``>= n_b``)
    see the kept context and every earlier token after it, and evict nothing."""
    slots_BS = positions_BS - cache.shift[:, None]
    out, dense = dense_cache_attention(layer, q_BSHD, k_BSKD, v_BSKD, slots_BS, cache.dense,
                                       visible_BKST=cache.visible[layer][:, :, None, :])
    return out, cache.replace(dense=dense)
