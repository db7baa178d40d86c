"""Every KV cache kvjax runs, behind one interface.

A *cache policy* is a frozen dataclass with

- ``init(params, cfg, batch, max_len, dtype, lengths_B) -> state``: an empty cache pytree;
- ``backend(params, layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, state) -> (out_BSHD, state)``:
  the attention of one layer (prefill when ``S > 1``, one decode step when ``S == 1``),
  storing the new keys and values.

``params`` are the policy's arrays (scorer weights), passed apart so ``jax.jit`` can treat
the policy itself as static. The caches:

- :class:`DenseCache` (:class:`DenseKV`): every token, slot ``t`` = position ``t``;
- :class:`BoundedCache`: one :class:`SlotBuffer` of ``s + w + k_max`` slots per layer and
  KV head (the eviction policies of :mod:`kvjax.eviction`);
- :class:`CompressedCache`: the dense cache with a per-head visibility mask (prefill
  compression, kvpress's setting), and :class:`CompactCache`, the same with the evicted
  entries dropped (what a decode after the compression reads).
"""

from kvjax.cache.compressed import CompactCache, CompressedCache
from kvjax.cache.dense import DenseCache, DenseKV, dense_cache_attention
from kvjax.cache.slots import BoundedCache, SlotBuffer

__all__ = ["DenseCache", "DenseKV", "dense_cache_attention", "BoundedCache", "SlotBuffer", "CompressedCache",
           "CompactCache"]
