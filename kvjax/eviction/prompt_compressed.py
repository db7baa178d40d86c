"""Prefill compression (kvpress's setting): dense prefill, the context's cache compressed
once, then decoding adds every new token without eviction.

Any policy of the one mechanism ranks the context: static-priority policies by their
priorities ``p_t`` (scorers, K-norm, random, oracles), attention-statistic policies by their
prefill statistic (SnapKV's pooled observation-window attention, H2O's accumulated attention,
TOVA's last-query attention), computed over the context alone (causal attention: a context
query never sees the question). Per row ``b`` and KV head, the context of ``n_b`` tokens keeps

    sinks:  t < s
    window: n_b - w <= t < n_b           (the context's last ``w`` tokens, as kvjax's keep rule)
    top:    the ``c_b - s - w`` other context tokens of highest priority (ties: the later token)

with ``c_b = round((1 - ratio) * n_b)`` (kvpress keeps ``int(n_b (1 - ratio))``; the window
counts toward it, as in kvpress's SnapKV). The question (tokens ``t >= n_b`` of the prompt) and
every generated token attend the kept context plus all tokens after it, and are never evicted.
StreamingLLM ranks nothing (``s`` sinks + the ``c_b - s`` most recent context tokens).

The cache is the dense one with a per-head visibility mask ``[B, K, T]``: the attention
outputs equal those of a cache that dropped the evicted entries (as kvpress does; RoPE is
applied before caching, so kept keys keep their positions). The memory is saved once the
evicted entries are dropped: :func:`kvjax.eviction.shared_prefill.answer` decodes from the
:class:`~kvjax.cache.CompactCache` (``kvjax.cache.compressed.compact``); the bounded cache is
the mechanism that never holds more than its budget.
Policies with learned per-head budgets (LKV-H: ``lkv``, ``lkv_kvpop_mlstm``) split the same
total across heads: head ``h`` of layer ``l`` keeps ``floor(b_lh (c_b - s - w) / topk)`` top
tokens besides its sinks and window, ``b_lh`` its long-range budget at the ranker's ``topk``
(uniform policies: ``b_lh = topk``, so every head keeps ``c_b``; StreamingLLM's ``c_b - s``
recent tokens need no budget). PyramidKV's layer budgets split it the same way; under Ada-KV
(``budgets="adakv"``) each layer keeps the best ``K (c_b - s - w)`` candidates of all its heads
together (:func:`adakv_keep_context`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import CompressedCache, DenseCache, dense_cache_attention
from kvjax.eviction.bounded import BoundedPolicy
from kvjax.eviction.budgets import adakv_select
from kvjax.eviction.fenwick import token_ranks


def _context_sets(S: int, context_B, sinks: int, window: int):
    """``(protected, eligible)`` ``bool [B, 1, S]``: each row's sinks and last ``window`` context
    tokens, and its other context tokens (both false for ``t >= n_b``)."""
    t = jnp.arange(S)[None, None, :]
    n = context_B[:, None, None]
    protected = (t < n) & ((t < sinks) | (t >= n - window))
    return protected, (t < n) & ~protected


def resolved_head_norm(ranker) -> str:
    """``ranker``'s ``EvictionConfig.head_norm`` with ``"auto"`` resolved: as they are for a
    ranker with ``comparable_priorities``, z-scored per head otherwise."""
    how = ranker.effective().head_norm
    if how != "auto":
        return how
    return "none" if ranker.comparable_priorities else "zscore"


def keep_context(prio_BKS, context_B, keep_B, *, sinks: int, window: int) -> jax.Array:
    """``bool [B, K, S]``: the context tokens kept by the rule of the module docstring
    (false for ``t >= n_b``). ``keep``: tokens kept per row ``[B]`` or per row and head
    ``[B, K]``. ``prio`` may hold ``-inf``; ties go to the later token."""
    protected, eligible = _context_sets(prio_BKS.shape[-1], context_B, sinks, window)
    rank = token_ranks(jnp.where(eligible, prio_BKS, jnp.nan))         # 0 = best eligible token; NaN last
    keep = jnp.asarray(keep_B)
    keep_BK = keep[:, None] if keep.ndim == 1 else keep
    n_top = jnp.maximum(keep_BK - sinks - window, 0)[:, :, None]
    return protected | (eligible & (rank < n_top))


def head_normalised(prio_BLKS, eligible_B11S, how: str) -> jax.Array:
    """``prio`` with each row, layer and head's priorities over its eligible context tokens made
    comparable across heads: ``"none"`` as they are, ``"zscore"`` ``(p - mean) / std`` over the
    eligible finite entries (others unchanged)."""
    if how == "none":
        return prio_BLKS
    if how != "zscore":
        raise ValueError(f"head_norm must be 'none' or 'zscore' here, got {how!r}")
    p = prio_BLKS.astype(jnp.float32)
    w = eligible_B11S & jnp.isfinite(p)
    n = jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1)
    mean = jnp.sum(jnp.where(w, p, 0.0), axis=-1, keepdims=True) / n
    var = jnp.sum(jnp.where(w, (p - mean) ** 2, 0.0), axis=-1, keepdims=True) / n
    return jnp.where(w, (p - mean) / jnp.sqrt(var + 1e-12), p)


def shared_keep_context(prio_LBKS, context_B, keep_B, *, sinks: int, window: int, scope: str,
                        norm: str = "none") -> jax.Array:
    """``bool [L, B, K, S]``: every head's sinks and last ``window`` context tokens, and the best
    ``L K (c_b - s - w)`` other context tokens of all layers and heads together (``scope="global"``)
    or ``K (c_b - s - w)`` of each layer's heads (``"layer"``); ``keep_B`` is ``c_b``. ``norm``
    (:func:`head_normalised`) puts each head's priorities on one scale first. Ties: the later
    token (in layer, head, position order)."""
    L, B, K, S = prio_LBKS.shape
    protected, eligible = _context_sets(S, context_B, sinks, window)                  # [B, 1, S]
    prio = head_normalised(jnp.moveaxis(prio_LBKS, 0, 1), eligible[:, None], norm)    # [B, L, K, S]
    prio = jnp.where(eligible[:, None], prio, jnp.nan)
    n_top = jnp.maximum(jnp.asarray(keep_B) - sinks - window, 0)                      # [B]
    if scope == "global":
        rank = token_ranks(prio.reshape(B, 1, L * K * S)).reshape(B, L, K, S)
        top = rank < (L * K * n_top)[:, None, None, None]
    elif scope == "layer":
        rank = token_ranks(prio.reshape(B, L, K * S)).reshape(B, L, K, S)
        top = rank < (K * n_top)[:, None, None, None]
    else:
        raise ValueError(f"shared_keep_context: scope must be 'global' or 'layer', got {scope!r}")
    kept = protected[:, None] | (eligible[:, None] & top)
    return jnp.moveaxis(kept, 1, 0)


def adakv_keep_context(prio_BKS, context_B, keep_BK, *, sinks: int, window: int, alpha: float) -> jax.Array:
    """:func:`keep_context` under Ada-KV's split (:func:`kvjax.eviction.budgets.adakv_select`):
    every head keeps its sinks and window; the layer's ``sum_h (keep_bh - s - w)`` other
    kept tokens are the best of all heads' candidates, each head guaranteed its own best
    ``floor(alpha (c_b - s - w))``."""
    protected, eligible = _context_sets(prio_BKS.shape[-1], context_B, sinks, window)
    K = prio_BKS.shape[1]
    n_top = jnp.sum(jnp.maximum(jnp.asarray(keep_BK) - sinks - window, 0), axis=-1) // K   # [B], uniform share
    return protected | adakv_select(prio_BKS, eligible, n_top, alpha)


def attend_kept(layer: int, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache: CompressedCache):
    """Attention backend after the compression: any number of queries at any positions see
    the kept context plus every later token (causal), and evict nothing."""
    out, dense = dense_cache_attention(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache.dense,
                                       visible_BKST=cache.keep[layer][:, :, None, :])
    return out, cache.replace(dense=dense)


@dataclasses.dataclass(frozen=True)
class PromptCompressed:
    """``ranker`` (any bounded policy; its configured ``sinks``/``window`` are used, its
    ``topk`` is not: the ratio sets the budget) compresses each
    row's first ``params["context"][b]`` prompt tokens to ``round((1 - ratio) n_b)``.

    Build with :func:`prompt_compressed`, which puts the context lengths and the ratio into
    ``params`` (traced: one compiled program serves every ratio).
    """

    ranker: BoundedPolicy
    ratio: float = dataclasses.field(compare=False)
    params: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    static = False

    @property
    def name(self) -> str:
        return f"{self.ranker.name}@prefill-compressed"

    def check_model(self, cfg) -> None:
        self.ranker.check_model(cfg)

    @property
    def shared_budget(self) -> bool:
        """One top-k over all layers (``budgets="global"``) or each layer's heads (``"layer"``)."""
        return self.ranker.effective().budgets in ("global", "layer")

    @property
    def needs_table(self) -> bool:
        """A shared budget over priorities that the prompt's pass computes (every ranker but
        KVzip and the oracles, whose tables exist before it): all layers' priorities are gathered
        from a dense pass of the context first (:meth:`prepare`; ``shared_prefill.compress``
        gathers them from its own prefill)."""
        return (self.shared_budget and not getattr(self.ranker, "table_priorities", False)
                and not hasattr(self.ranker, "scored"))

    @property
    def head_norm(self) -> str:
        """How the shared budget compares heads (``EvictionConfig.head_norm``; ``"auto"``: as they
        are for rankers with ``comparable_priorities``, z-scored per head otherwise)."""
        return resolved_head_norm(self.ranker)

    def prepare(self, model, tokens_BS, lengths_B) -> "PromptCompressed":
        """A ranker that scores its context by a pass of its own (KVzip's reconstruction) runs it
        on a dense prefill of the contexts, and a shared budget over priorities of the prompt's
        pass gathers every layer's from one (``kvjax.generate`` calls this before the prompt)."""
        scored = hasattr(self.ranker, "scored") and self.params["ranker"] is None
        if not scored and not (self.needs_table and self.params.get("table") is None):
            return self
        if self.needs_table and not self.ranker.static and getattr(self.ranker, "needs_queries", True):
            raise ValueError(f"policy {self.ranker.name!r}: budgets={self.ranker.effective().budgets!r} ranks all "
                             "layers together, so every layer's priorities must exist before the prompt's pass; an "
                             "attention statistic needs the prompt's queries for them: compress through "
                             "kvjax.eviction.shared_prefill (prefill_context(keep_queries=True), then compress)")
        from flax import nnx

        from kvjax.sampling import bucket

        n = np.asarray(self.params["context"])
        contexts = [np.asarray(tokens_BS[b, :n[b]]).tolist() for b in range(len(n))]
        padded = np.zeros((len(n), bucket(int(n.max()))), np.int32)
        for b, c in enumerate(contexts):
            padded[b, :len(c)] = c
        graphdef, params = nnx.split(model)
        dense = _context_cache(graphdef, params, jnp.asarray(padded))
        if scored:
            return self.with_ranker(self.ranker.scored(model, dense.k, dense.v, contexts))
        table = _context_table(self, self.params, model.config, dense)
        return dataclasses.replace(self, params={**self.params, "table": table})

    def context_table(self, params, cfg, k_LBKTD, v_LBKTD) -> jax.Array:
        """``float32 [L, B, K, T]``: the ranker's priority of every context token in every layer,
        from the dense context cache's keys and values (static rankers and KeyDiff)."""
        B, _, T, _ = k_LBKTD[0].shape
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        states = self.ranker.init_policy_state(params["ranker"], cfg, B) if self.ranker.static else ()
        return jnp.stack([self.priority(params, layer, None, jnp.swapaxes(k_LBKTD[layer], 1, 2),
                                        jnp.swapaxes(v_LBKTD[layer], 1, 2), positions,
                                        states[layer] if states else None)
                          for layer in range(cfg.num_layers)]).astype(jnp.float32)

    def with_ranker(self, ranker) -> "PromptCompressed":
        return dataclasses.replace(self, ranker=ranker, params={**self.params, "ranker": ranker.params})

    def init(self, params, cfg, batch: int, max_len: int, dtype, lengths_B) -> CompressedCache:
        if self.shared_budget:
            keep = self._shared_keep(params, cfg, max_len)
        else:
            keep = tuple(jnp.ones((batch, cfg.num_kv_heads, max_len), bool) for _ in range(cfg.num_layers))
        return CompressedCache(DenseCache.init(cfg, batch, max_len, dtype), keep,
                               self.ranker.head_budgets(params["ranker"], cfg, batch),
                               self.ranker.init_policy_state(params["ranker"], cfg, batch) if self.ranker.static else ())

    def _shared_keep(self, params, cfg, T: int) -> tuple:
        """Every layer's visible slots under a budget shared across heads (and layers), from the
        ranker's priority table (KVzip, the oracles) or the one gathered for it (:meth:`prepare`)."""
        r = self.ranker
        ev, context = r.config, params["context"]
        if self.needs_table:
            table = params.get("table")
            if table is None:
                raise ValueError(f"policy {r.name!r}: budgets={r.effective().budgets!r} needs every layer's "
                                 "priorities before the pass: run it through kvjax.generate (which gathers them) "
                                 "or kvjax.eviction.shared_prefill.compress")
            table = jnp.pad(table[..., :T], ((0, 0), (0, 0), (0, 0), (0, max(T - table.shape[-1], 0))))
        else:
            table = jnp.stack([r.priority(params["ranker"], layer, None, None,
                                          jnp.broadcast_to(jnp.arange(T), (context.shape[0], T)))
                               for layer in range(cfg.num_layers)])                          # [L, B, K, T]
        total = jnp.round((1.0 - params["ratio"]) * context).astype(jnp.int32)
        kept = shared_keep_context(table, context, total, sinks=ev.sinks, window=ev.window,
                                   scope=r.effective().budgets, norm=self.head_norm)
        t = jnp.arange(T)[None, None, :]
        return tuple((t >= context[:, None, None]) | kept[layer] for layer in range(cfg.num_layers))

    def head_keep(self, budgets_BK, context_B, ratio=None) -> jax.Array:
        """``int32 [B, K]``: context tokens each head keeps (sinks + window + its share of the top)."""
        ev, topk = self.ranker.config, self.ranker.effective().topk      # StreamingLLM: topk 0, all recency
        ratio = self.ratio if ratio is None else ratio
        total = jnp.round((1.0 - ratio) * context_B).astype(jnp.int32)                   # c_b
        top = jnp.maximum(total - ev.sinks - ev.window, 0)[:, None]
        share = (budgets_BK * top) // topk if topk > 0 else top
        return ev.sinks + ev.window + jnp.broadcast_to(share, budgets_BK.shape)

    def priority(self, params, layer: int, q_BSHD, k_BSKD, v_BSKD, positions_BS, state) -> jax.Array:
        """``[B, K, S]``: the ranker's priority of each prompt token (static priorities from keys and
        values, attention statistics from the prompt's causal attention; only ``t < n_b`` is used)."""
        r = self.ranker
        if r.static:
            return r.prefill_priority(params["ranker"], layer, k_BSKD, v_BSKD, positions_BS, params["context"],
                                      state)[0]
        return r.prefill_statistic(q_BSHD, k_BSKD, params["context"])

    @property
    def statistic_key(self) -> tuple | None:
        """What an attention-statistic ranker's :meth:`priority` depends on besides the batch
        (its statistic, query rows, window and pooling; not its budget): policies with equal
        keys rank a batch identically (SnapKV, PyramidKV and Ada-KV at any ratio share one).
        ``None`` for static rankers (scorers, K-norm, oracles: their priorities are their own)."""
        r = self.ranker
        if r.static:
            return None
        return (type(r).prefill_statistic, type(r).prefill_scores, r.score_rows, r.config.obs_window, r.config.pool)

    def keep_from_priority(self, params, prio_BKS, budgets_BK, T: int) -> jax.Array:
        """``bool [B, K, T]``: the visible slots after the compression: the kept context and every
        slot past it."""
        ev, context = self.ranker.config, params["context"]
        if self.ranker.effective().budgets == "adakv":
            kept = adakv_keep_context(prio_BKS, context, self.head_keep(budgets_BK, context, params["ratio"]),
                                      sinks=ev.sinks, window=ev.window, alpha=self.ranker.effective().adakv_alpha)
        else:
            kept = keep_context(prio_BKS, context, self.head_keep(budgets_BK, context, params["ratio"]),
                                sinks=ev.sinks, window=ev.window)
        t = jnp.arange(T)[None, None, :]
        return (t >= context[:, None, None]) | jnp.pad(kept, ((0, 0), (0, 0), (0, T - kept.shape[-1])))

    def layer_keep(self, params, layer: int, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache: CompressedCache):
        """This layer's :meth:`keep_from_priority` from the prompt's queries, keys and values (under
        a shared budget: the set :meth:`init` chose)."""
        if self.shared_budget:
            return cache.keep[layer]
        prio = self.priority(params, layer, q_BSHD, k_BSKD, v_BSKD, positions_BS,
                             cache.policy_state[layer] if cache.policy_state else None)
        return self.keep_from_priority(params, prio, cache.budgets[layer], cache.keep[layer].shape[-1])

    def backend(self, params, layer: int, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache: CompressedCache):
        """A prompt (``S > 1``, from position 0) attends densely over the context and the question
        sees what is kept; later calls attend under the kept set (:func:`attend_kept`)."""
        if q_BSHD.shape[1] == 1:
            return attend_kept(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache)
        keep = self.layer_keep(params, layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache)
        in_context = positions_BS < params["context"][:, None]                             # [B, S]
        visible = keep[:, :, None, :] | in_context[:, None, :, None]
        out, dense = dense_cache_attention(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache.dense,
                                           visible_BKST=visible, prefill=True)
        keeps = cache.keep[:layer] + (keep,) + cache.keep[layer + 1:]
        return out, cache.replace(dense=dense, keep=keeps)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _context_table(policy: PromptCompressed, params, cfg, dense: DenseCache) -> jax.Array:
    return policy.context_table(params, cfg, dense.k, dense.v)


@functools.partial(jax.jit, static_argnums=0)
def _context_cache(graphdef, params, tokens_BS) -> DenseCache:
    """The dense cache of a prefill of ``tokens`` (right padded contexts)."""
    from flax import nnx

    model = nnx.merge(graphdef, params)
    B, S = tokens_BS.shape
    _, cache = model(tokens_BS, None, functools.partial(dense_cache_attention, prefill=True),
                     DenseCache.init(model.config, B, S, model.dtype))
    return cache


def prompt_compressed(ranker: BoundedPolicy, ratio: float, context_lengths_B) -> PromptCompressed:
    """``ranker`` compressing each row's first ``context_lengths_B[b]`` prompt tokens to
    ``round((1 - ratio) * n_b)`` once, after a dense prefill (see the module docstring)."""
    import numpy as np

    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    n = np.asarray(context_lengths_B, np.int32).reshape(-1)
    if n.size == 0 or n.min() < 1:
        raise ValueError("context_lengths_B: every row needs a context of at least one token")
    ev = ranker.config
    small = n[np.round((1.0 - ratio) * n) < ev.sinks + ev.window]
    if small.size:
        raise ValueError(f"ratio {ratio} of a {int(small[0])}-token context keeps fewer tokens than "
                         f"sinks + window = {ev.sinks + ev.window}")
    return PromptCompressed(ranker, float(ratio), {"ranker": ranker.params, "context": jnp.asarray(n),
                                                   "ratio": jnp.float32(ratio)})
