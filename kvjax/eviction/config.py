"""``EvictionConfig``: the per-KV-head budget ``B = sinks + window + topk``, and the budget a
compression ratio gives at a length (:func:`budget_at`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

# A policy made or loaded without a budget keeps this share of the prompt out of its cache
# (75%: it holds a quarter of the prompt's tokens per KV head), as the README's tables do, with
# this many sinks and recent tokens protected (kvjax.make_policy, kvjax.load_scorers).
DEFAULT_COMPRESSION = 0.75
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 32
# how the long-range slots are split across layers and heads (EvictionConfig.budgets)
BUDGET_RULES = ("uniform", "pyramid", "adakv", "shares", "global", "layer")
PREFILL_MODES = ("auto", "chunked", "stepwise", "compressed")   # EvictionConfig.prefill
HEAD_NORMS = ("auto", "none", "zscore")   # EvictionConfig.head_norm


@dataclasses.dataclass(frozen=True)
class EvictionConfig:
    """Budget of a bounded KV cache, per batch row, layer and KV head.

    sinks: the first ``sinks`` tokens, always kept.
    window: the ``window`` most recent tokens (incl. the current one), always kept (>= 1).
    topk: long-range slots, filled by the policy's priorities.
    k_max: slots allocated for long-range tokens (default ``topk``); LKV heads use
      per-head budgets ``<= k_max``.
    seed: for the ``random`` policy.
    obs_window: SnapKV's observation window (queries), also its refresh period in decoding.
    pool: SnapKV's pooling kernel over positions (odd).
    kernel: backend of the sparse prefill attention and the decode step (``pallas_kernels``):
      ``"auto"`` (the platform's Pallas kernel, the XLA reference on CPU), ``"xla"``, ``"tpu"``,
      ``"gpu"``; ``kernel_interpret`` runs a kernel in Pallas interpret mode (tests on CPU).
    prefill: how the prompt enters the cache, the one prefill setting (``generate`` reads it):
      ``"auto"`` one pass (static priorities keep their budget already in the prompt, through the
      keep rule; attention statistics attend densely and compress when the prompt ends);
      ``"chunked"`` static priorities ``prefill_chunk`` queries at a time over the slot buffer plus
      the chunk (:mod:`kvjax.eviction.chunked`; the same kept sets and outputs as one pass,
      attention memory ``O(C (s + w + k_max + C))`` instead of ``O(S^2)``); ``"stepwise"`` token by
      token through the decode path (every policy bounded throughout); ``"compressed"`` kvpress's
      setting (:mod:`kvjax.eviction.prompt_compressed`: dense prefill, the prompt compressed once
      to ``round((1 - c) n)`` entries per head, nothing evicted afterwards; needs a compression).
    prefill_chunk: the chunk of ``prefill="chunked"`` (queries).
    budgets: how the long-range slots are split across layers and heads at the same total
      (:mod:`kvjax.eviction.budgets`): ``"uniform"`` (``topk`` each), ``"pyramid"`` (PyramidKV:
      falling with depth, none above ``k_max``), ``"adakv"`` (Ada-KV: per layer, the best
      candidates of all heads, from the ranker's scores); ``pyramid_beta`` and ``adakv_alpha``
      are their parameters (the papers' defaults 20 and 0.2); ``"shares"`` (a fixed split, e.g. a
      diagnostic: head ``(l, k)`` gets ``floor(head_shares[l][k] * topk)`` slots, at most ``k_max``;
      shares of mean 1 keep the uniform total, a large share keeps that head's whole context);
      ``"global"`` (one top-k over all layers and heads, KVzip's) and ``"layer"`` (one per layer
      over its heads): prefill compression, for every static-priority ranker and KeyDiff
      (:func:`kvjax.eviction.prompt_compressed.shared_keep_context`).
    head_norm: how a shared budget (``"global"``, ``"layer"``) compares priorities of different
      heads: ``"none"`` (as they are: priorities on one scale, the oracles' log attention mass,
      KVzip's attention probability, a KVpop scorer fitted to its target's levels (``levels``,
      not centred)), ``"zscore"`` (each head's priorities over its eligible context tokens
      standardised to mean 0 and variance 1: K-norm, KeyDiff, random, whose scales differ by
      head, and centred scorer fits, each head known up to an offset of its own), ``"auto"``
      (the ranker's own: ``comparable_priorities``).
    """

    sinks: int = 4                       # first tokens always kept
    window: int = 64                     # most recent tokens always kept (>= 1)
    topk: int = 64                       # long-range slots per head, filled by priority (LKV: the mean over heads)
    k_max: int | None = None             # long-range slots allocated per head (default topk; LKV: > topk)
    seed: int = 0                        # the random policy's seed
    obs_window: int = 16                 # SnapKV: observation window (queries) and decode refresh period
    pool: int = 7                        # SnapKV: pooling kernel over positions (odd)
    kernel: str = "auto"                 # sparse attention / decode backend: auto | xla | tpu | gpu
    kernel_interpret: bool = False       # run a kernel backend in Pallas interpret mode (CPU tests)
    prefill: str = "auto"                # how the prompt enters: auto | chunked | stepwise | compressed
    prefill_chunk: int = 0               # prefill="chunked": queries per chunk
    budgets: str = "uniform"             # long-range slots per head: uniform | pyramid | adakv
    pyramid_beta: float = 20.0           # PyramidKV: last layer's budget = topk / beta
    adakv_alpha: float = 0.2             # Ada-KV: each head's guaranteed share of topk
    head_shares: tuple[tuple[float, ...], ...] | None = None   # budgets="shares": [L][K] multiples of topk
    head_norm: str = "auto"              # shared budgets: how heads' priorities compare: auto | none | zscore

    label: ClassVar[str] = "EvictionConfig"   # names the fields in errors ("eviction" in a train config)

    def __post_init__(self):
        c = self.label
        for name in ("sinks", "topk", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{c}.{name} must be a non-negative integer, got {v!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int):
            raise ValueError(f"{c}.window must be an integer, got {self.window!r}")
        if self.window < 1:
            raise ValueError(f"{c}.window must be >= 1, got {self.window!r} (the current token is always kept)")
        if self.k_max is not None and (not isinstance(self.k_max, int) or self.k_max < 0):
            raise ValueError(f"{c}.k_max must be a non-negative integer, got {self.k_max!r}")
        if self.k_max is not None and self.topk > self.k_max:
            raise ValueError(f"{c}.topk ({self.topk}) must be <= k_max ({self.k_max})")
        if self.obs_window < 1:
            raise ValueError(f"{c}.obs_window must be >= 1, got {self.obs_window}")
        if self.kernel not in ("auto", "xla", "tpu", "gpu"):
            raise ValueError(f"{c}.kernel must be 'auto', 'xla', 'tpu' or 'gpu', got {self.kernel!r}")
        if isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
            raise ValueError(f"{c}.prefill_chunk must be a non-negative integer, got {self.prefill_chunk!r}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"{c}.prefill must be one of {', '.join(map(repr, PREFILL_MODES))}, got {self.prefill!r}")
        if (self.prefill == "chunked") != (self.prefill_chunk > 0):
            raise ValueError(f"{c}.prefill_chunk is the chunk of prefill='chunked': give prefill='chunked' with "
                             f"prefill_chunk > 0 (got prefill={self.prefill!r}, prefill_chunk={self.prefill_chunk})")
        if self.budgets not in BUDGET_RULES:
            raise ValueError(f"{c}.budgets must be one of {', '.join(map(repr, BUDGET_RULES))}, got {self.budgets!r}")
        if self.head_norm not in HEAD_NORMS:
            raise ValueError(f"{c}.head_norm must be one of {', '.join(map(repr, HEAD_NORMS))}, got {self.head_norm!r}")
        if (self.budgets == "shares") != (self.head_shares is not None):
            raise ValueError(f"{c}.head_shares: give it exactly when budgets='shares' (budgets={self.budgets!r})")
        if self.head_shares is not None:
            try:
                rows = tuple(tuple(float(x) for x in row) for row in self.head_shares)
            except (TypeError, ValueError):
                raise ValueError(f"{c}.head_shares must be a [layers][kv_heads] table of numbers, "
                                 f"got {self.head_shares!r}") from None
            if not rows or len({len(r) for r in rows}) != 1 or any(not 0 <= x < float("inf") for r in rows for x in r):
                raise ValueError(f"{c}.head_shares must be a non-empty rectangular [layers][kv_heads] table of "
                                 f"finite shares >= 0, got {self.head_shares!r}")
            object.__setattr__(self, "head_shares", rows)       # hashable (a jit static argument)
        if not self.pyramid_beta >= 1:
            raise ValueError(f"{c}.pyramid_beta must be >= 1, got {self.pyramid_beta!r}")
        if not 0.0 <= self.adakv_alpha <= 1.0:
            raise ValueError(f"{c}.adakv_alpha must be in [0, 1], got {self.adakv_alpha!r}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"{c}.pool must be a positive odd integer, got {self.pool}")

    @property
    def slots(self) -> int:
        """Long-range slots allocated (``k_max``)."""
        return self.topk if self.k_max is None else self.k_max

    @property
    def budget(self) -> int:
        return self.sinks + self.window + self.topk

    def check_fits(self, max_positions: int) -> None:
        if self.sinks + self.window + self.slots > max_positions:
            raise ValueError(f"EvictionConfig: budget sinks+window+k_max = {self.sinks + self.window + self.slots} "
                             f"exceeds the model's max_position_embeddings={max_positions}")


def check_compression(compression, what: str = "compression") -> float:
    """``compression`` as a float in ``[0, 1)``, or a clear error."""
    if isinstance(compression, bool) or not isinstance(compression, (int, float)) or not 0.0 <= compression < 1.0:
        raise ValueError(f"{what} must be a number in [0, 1) (the share of the prompt's tokens evicted, "
                         f"e.g. 0.75 keeps a quarter), got {compression!r}")
    return float(compression)


def kept_slots(compression: float, length: int) -> int:
    """``round((1 - compression) * length)``: the slots per KV head a compression ratio keeps of
    ``length`` tokens. The one place this is computed (the budgets, the configs' checks)."""
    return int(round((1.0 - compression) * length))


def budget_at(base: EvictionConfig, compression: float, length: int) -> EvictionConfig:
    """``base`` with ``sinks + window + topk = max(1, round((1 - compression) length))`` slots per
    KV head and ``k_max`` unset: the sinks and window are ``base``'s, shrunk only when the budget
    is smaller than they are (sinks first keep one slot for the window); ``topk`` takes the rest.
    Every other field (kernel, SnapKV's window, the budget rule) is ``base``'s."""
    compression = check_compression(compression)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"budget_at: length must be a positive integer, got {length!r}")
    total = max(1, kept_slots(compression, length))
    sinks = min(base.sinks, total - 1)
    window = min(base.window, total - sinks)
    return dataclasses.replace(base, sinks=sinks, window=window, topk=total - sinks - window, k_max=None)
