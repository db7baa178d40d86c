"""Budgets at a compression ratio, scaled like the KVpop seed (4 sinks, a window of
1/16 of the budget: 256 of 4096)."""

from __future__ import annotations

from kvjax.eviction.config import EvictionConfig


def budget_for(length: int, compression: float, *, sinks: int = 4, window_frac: float = 1 / 16) -> EvictionConfig:
    """``EvictionConfig`` whose ``sinks + window + topk = round((1 - compression) * length)``."""
    if not 0.0 <= compression < 1.0:
        raise ValueError(f"compression must be in [0, 1), got {compression}")
    total = max(int(round((1.0 - compression) * length)), sinks + 2)
    window = max(1, int(round(total * window_frac)))
    return EvictionConfig(sinks=sinks, window=window, topk=total - sinks - window)
