"""The prefill-compressed cache (:mod:`kvjax.eviction.prompt_compressed`): the dense cache with a
per-head visibility mask, so outputs equal those of a cache that dropped the evicted entries."""

from __future__ import annotations

import jax
from flax import struct

from kvjax.cache.dense import DenseCache


@struct.dataclass
class CompressedCache:
    dense: DenseCache
    keep: tuple[jax.Array, ...]   # per layer bool [B, K, T]: slot visible to later queries
    budgets: jax.Array            # int32 [L, B, K]: the ranker's long-range budget per head (at its topk)
    policy_state: tuple = ()      # a static ranker's per-layer state (the mLSTM's memory)
