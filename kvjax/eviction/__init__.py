"""Eviction: the keep rule and its running top-k cutoffs."""

from kvjax.eviction.fenwick import (
    cutoffs_from_ranks,
    fenwick_cutoffs,
    fenwick_cutoffs_sequential,
    naive_cutoffs,
    token_ranks,
)
from kvjax.eviction.keep_rule import (
    CompactKeep,
    compact_keep,
    keep_mask,
    keep_mask_from_compact,
    static_priority,
)

__all__ = [
    "CompactKeep",
    "compact_keep",
    "cutoffs_from_ranks",
    "fenwick_cutoffs",
    "fenwick_cutoffs_sequential",
    "keep_mask",
    "keep_mask_from_compact",
    "naive_cutoffs",
    "static_priority",
    "token_ranks",
]
