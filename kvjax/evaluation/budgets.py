"""Budgets at a compression ratio, scaled like the KVpop seed (4 sinks, a window of
1/16 of the budget: 256 of 4096)."""

from __future__ import annotations

import math

from kvjax.eviction.config import EvictionConfig, kept_slots


def budget_for(length: int, compression: float, *, sinks: int = 4, window_frac: float = 1 / 16,
               window: int | None = None) -> EvictionConfig:
    """``EvictionConfig`` whose ``sinks + window + topk = round((1 - compression) * length)``.

    The recent window is ``window_frac`` of the budget (at least 1), or ``window`` tokens when
    given (a fixed window: at 94% of 512 tokens the default leaves 2, too few for the
    testbed's local arithmetic)."""
    if not 0.0 <= compression < 1.0:
        raise ValueError(f"compression must be in [0, 1), got {compression}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    total = max(kept_slots(compression, length), sinks + 2)
    win = max(1, int(round(total * window_frac))) if window is None else window
    if sinks + win >= total:
        raise ValueError(f"a budget of {total} slots ({compression:.0%} of {length} tokens) leaves no top-k slot "
                         f"after {sinks} sinks + {win} window; lower the window or the compression")
    return EvictionConfig(sinks=sinks, window=win, topk=total - sinks - win)


def fixed_window_budget(length: int, compression: float, *, sinks: int, window: int) -> EvictionConfig:
    """``EvictionConfig`` with the given sinks and window and ``topk`` filling the rest of
    ``round((1 - compression) * length)`` slots (the real-model evaluations' budgets)."""
    total = kept_slots(compression, length)
    if sinks + window > total:
        raise ValueError(f"{sinks} sinks + {window} window exceed the budget of {total} slots "
                         f"({compression:.0%} of {length} tokens); lower the window or the compression")
    return EvictionConfig(sinks=sinks, window=window, topk=total - sinks - window)
