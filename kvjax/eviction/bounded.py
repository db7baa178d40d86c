"""The one mechanism every eviction policy runs on: a bounded cache (one :class:`SlotBuffer`
per layer, see :mod:`kvjax.cache.slots`) and two policy protocols over it.

- :class:`StaticPriority` -- a token's priority is fixed once it exists (KVpop, LKV, K-norm,
  random, the oracles, StreamingLLM). Prefill is one pass of keep-rule attention (the
  ``pallas_kernels`` sparse kernel); in decoding the token leaving the window gets its
  priority (``exit_priority``) and competes for a long-range slot.
- :class:`AttentionStatistic` -- a slot's priority is an attention statistic that changes
  every step (TOVA, H2O, SnapKV). Prefill is dense attention followed by selection, as in
  kvpress; in decoding each step's attention probabilities update the statistic.

A policy is a frozen (hashable) dataclass, so ``jax.jit`` treats it as static; its arrays
(scorer weights, oracle priorities) travel separately as ``params``, and its per-layer state
(the mLSTM scorer's memory, an attention statistic per slot) is its own pytree in
``BoundedCache.policy_state``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

import pallas_kernels

from kvjax.eviction.attention import slot_attention, statistic_scores
from kvjax.eviction.budgets import adakv_budgets, adakv_select, pyramid_budgets, shares_budgets
from kvjax.eviction.chunked import chunked_prefill
from kvjax.eviction.config import EvictionConfig, budget_at, check_compression
from kvjax.eviction.fenwick import cutoffs_from_ranks, token_ranks
from kvjax.cache.slots import (BoundedCache, SlotBuffer, exiting_slot, gather_tokens, init_buffer, place,
                               prefill_buffer, put_side, read_side, read_slot, write)
from kvjax.models.attention import dense_attention


@dataclasses.dataclass(frozen=True)
class BoundedPolicy:
    """What both protocols share: the budget, weights, per-head budgets and cache set-up."""

    config: EvictionConfig = dataclasses.field(default_factory=EvictionConfig)
    params: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    # (layers, KV heads, head_dim, config sha256 or None) of the model learned weights were made for
    fits: tuple | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    # the budget as a share of the prompt evicted, resolved at the prompt's length by generate
    # (at_compression); None: ``config`` is the budget
    compression: float | None = None

    name: ClassVar[str] = "bounded"
    static: ClassVar[bool]          # set by the protocol: True for StaticPriority
    # priorities on one scale across heads and layers (log attention mass, attention probability),
    # so a shared budget compares them as they are (EvictionConfig.head_norm="auto")
    comparable_priorities: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.config, EvictionConfig):
            raise TypeError(f"policy {self.name!r}: config must be an EvictionConfig, got {type(self.config).__name__}")
        if self.compression is not None:
            object.__setattr__(self, "compression", check_compression(self.compression, f"policy {self.name!r}: "
                                                                                         "compression"))
            if self.config.topk != 0 or self.config.k_max is not None:
                raise ValueError(f"policy {self.name!r}: its budget is a compression ratio "
                                 f"({self.compression:.0%} of the prompt evicted), and a config with topk="
                                 f"{self.config.topk}, k_max={self.config.k_max} would conflict with it: for a fixed "
                                 "budget use policy.at_budget(config); with a ratio, the config gives the sinks, "
                                 "window and settings only (topk=0, k_max unset)")

        if self.config.prefill == "chunked" and not getattr(self, "static", True):
            raise ValueError(f"policy {self.name!r}: prefill='chunked' needs priorities known before the "
                             "attention (static priorities); an attention statistic prefills in one pass "
                             "('auto'), token by token ('stepwise') or compressed ('compressed')")

    def with_prefill(self, mode: str, chunk: int = 0) -> "BoundedPolicy":
        """This policy with its prompt entering as ``mode`` (``EvictionConfig.prefill``: auto |
        chunked | stepwise | compressed; ``chunk``: the queries per chunk of ``"chunked"``)."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, prefill=mode, prefill_chunk=chunk))

    # ---- the budget: one way to set it, for every policy ----------------------------------------
    def at_budget(self, config: EvictionConfig, context: int | None = None) -> "BoundedPolicy":
        """This policy at the fixed budget ``config``. Policies with learned per-head budgets keep
        their learned split, rescaled to ``config.topk`` (LKV-H); DuoAttention's retrieval heads
        keep up to ``context`` tokens (the longest sequence the cache will hold) when
        ``config.k_max`` is unset. ``dataclasses.replace(policy, config=...)`` is the same."""
        return dataclasses.replace(self, config=config, compression=None)

    def at_compression(self, compression: float, length: int) -> "BoundedPolicy":
        """This policy at the budget that evicts ``compression`` of ``length`` tokens
        (:func:`kvjax.eviction.config.budget_at`: ``round((1 - c) length)`` slots per KV head, this
        policy's sinks and window, the rest long-range)."""
        return self.at_budget(budget_at(self.config, compression, length), context=length)

    def resolved(self, length: int) -> "BoundedPolicy":
        """The policy with a fixed budget for a prompt of ``length`` tokens: itself when it has one."""
        return self if self.compression is None else self.at_compression(self.compression, length)

    def kv_bytes(self, cfg, batch: int, dtype) -> int:
        """Bytes of keys and values the bounded cache holds (all layers, ``batch`` rows), whatever
        the sequence length; the slot positions, priorities and policy state come on top."""
        ev = self.effective()
        n = ev.sinks + ev.window + ev.slots
        return 2 * cfg.num_layers * batch * cfg.num_kv_heads * n * cfg.head_dim * jnp.dtype(dtype).itemsize

    def effective(self) -> EvictionConfig:
        """The budget this policy actually runs with."""
        return self.config

    def head_budgets(self, params, cfg, batch: int):
        """``int32 [L, B, K]`` long-range slots each head may fill: ``topk``, PyramidKV's layer
        budgets (``budgets="pyramid"``) or a fixed split (``"shares"``). Ada-KV's start at ``topk``
        and follow the scores."""
        ev = self.effective()
        if ev.budgets == "pyramid":
            per_layer = jnp.asarray(pyramid_budgets(cfg.num_layers, ev.topk, ev.slots, ev.pyramid_beta), jnp.int32)
            return jnp.broadcast_to(per_layer[:, None, None], (cfg.num_layers, batch, cfg.num_kv_heads))
        if ev.budgets == "shares":
            b = shares_budgets(ev.head_shares, ev.topk, ev.slots, (cfg.num_layers, cfg.num_kv_heads))
            return jnp.broadcast_to(jnp.asarray(b)[:, None, :], (cfg.num_layers, batch, cfg.num_kv_heads))
        return jnp.full((cfg.num_layers, batch, cfg.num_kv_heads), ev.topk, jnp.int32)

    def init_policy_state(self, params, cfg, batch: int):
        """Per-layer policy state carried in the cache (default: none)."""
        return ()

    def check_model(self, cfg) -> None:
        """Refuse a model whose shapes differ from those the policy's weights were made for;
        warn when only the config hash differs (same shapes, perhaps another checkpoint)."""
        if self.fits is None:
            return
        L, K, D, digest = self.fits
        have = {"layers": cfg.num_layers, "KV heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
        want = {"layers": L, "KV heads": K, "head_dim": D}
        if have != want:
            diff = ", ".join(f"{n} {want[n]} vs {have[n]}" for n in want if want[n] != have[n])
            raise ValueError(f"policy {self.name!r}: its scorers were made for another model ({diff} in this "
                             f"model); export scorers for this model or load the model they belong to")
        if digest:
            from kvjax.config import config_hash

            if config_hash(cfg) != digest:
                import warnings

                warnings.warn(f"policy {self.name!r}: the model's config differs from the one its scorers were "
                              "exported with (same shapes); check that they belong together", stacklevel=3)

    def with_params(self, params) -> "BoundedPolicy":
        return dataclasses.replace(self, params=params)

    def init(self, params, cfg, batch: int, max_len: int, dtype, lengths_B) -> BoundedCache:
        if self.compression is not None:
            raise ValueError(f"policy {self.name!r} holds its budget as a compression ratio "
                             f"({self.compression:.0%} of the prompt evicted) and no length yet: use "
                             f"policy.at_compression({self.compression}, length) or policy.at_budget(config) "
                             "(kvjax.generate and TextGenerator resolve it at the prompt's length)")
        ev = self.effective()
        if ev.budgets in ("global", "layer") and not getattr(self, "table_priorities", False):
            raise ValueError(f"policy {self.name!r}: budgets={ev.budgets!r} (one top-k shared across heads) runs "
                             "in prefill compression (EvictionConfig(prefill='compressed') or "
                             "kvjax.prompt_compressed); bounded throughout it needs priorities known before the "
                             "pass (kvzip, the oracles)")
        if ev.budgets in ("global", "layer") and type(self).head_budgets is BoundedPolicy.head_budgets:
            raise ValueError(f"policy {self.name!r}: budgets={ev.budgets!r} bounded throughout needs each head's "
                             f"share of the shared budget, which {self.name!r} does not split (kvzip splits it "
                             "from its prompt scores); run it in prefill compression "
                             "(EvictionConfig(prefill='compressed'))")
        ev.check_fits(cfg.max_position_embeddings)
        budgets = self.head_budgets(params, cfg, batch)
        layers = tuple(init_buffer(ev, batch, cfg.num_kv_heads, cfg.head_dim, dtype, budgets[i])
                       for i in range(cfg.num_layers))
        return BoundedCache(layers, jnp.asarray(lengths_B, jnp.int32), self.init_policy_state(params, cfg, batch))

    def backend(self, params, layer: int, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache: BoundedCache):
        """The attention backend of :class:`kvjax.Decoder`: prefill when ``S > 1``, else one decode step."""
        if q_BSHD.shape[1] > 1:
            return self._prefill(params, layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache)
        return self._decode(params, layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache)

    def _policy_state(self, cache: BoundedCache, layer: int):
        return cache.policy_state[layer] if cache.policy_state else None


def _replace(cache: BoundedCache, layer: int, buf: SlotBuffer, state) -> BoundedCache:
    layers = cache.layers[:layer] + (buf,) + cache.layers[layer + 1:]
    if not cache.policy_state:
        return cache.replace(layers=layers)
    return cache.replace(layers=layers, policy_state=cache.policy_state[:layer] + (state,) + cache.policy_state[layer + 1:])


@dataclasses.dataclass(frozen=True)
class StaticPriority(BoundedPolicy):
    """Protocol 1: a policy supplies ``priority`` (and, if it carries state, the prefill and
    exit hooks); the keep rule and the slot buffer do the rest."""

    static: ClassVar[bool] = True

    def priority(self, params, layer: int, k_BSKD, v_BSKD, t_BS):
        """``float32 [B, K, S]`` priority of tokens at positions ``t``."""
        raise NotImplementedError(f"policy {self.name!r} defines no priority()")

    def prefill_priority(self, params, layer: int, k_BSKD, v_BSKD, positions_BS, lengths_B, state):
        """Prompt priorities ``[B, K, S]`` and this layer's policy state after the prompt."""
        return self.priority(params, layer, k_BSKD, v_BSKD, positions_BS), state

    def exit_priority(self, params, layer: int, k_new_BKD, v_new_BKD, k_exit_BKD, v_exit_BKD, t_B, state):
        """Priority ``[B, K]`` of the token leaving the window (after the current token ``q``
        arrived) and this layer's policy state."""
        return self.priority(params, layer, k_exit_BKD[:, None], v_exit_BKD[:, None], t_B[:, None])[:, :, 0], state

    def sparse_attention(self, q_BSHD, k_BSKD, v_BSKD, prio_BKS, budget_BK):
        """Keep-rule attention from static priorities, each head with its own long-range budget
        (the decode state's, so prefill and decode keep the same set), by the configured kernel."""
        ev = self.effective()
        rank = token_ranks(prio_BKS)
        cut = cutoffs_from_ranks(rank, sinks=ev.sinks, window=ev.window, topk=budget_BK)
        return pallas_kernels.sparse_attention(q_BSHD, k_BSKD, v_BSKD, rank, cut, sinks=ev.sinks, window=ev.window,
                                               backend=ev.kernel, interpret=ev.kernel_interpret)

    def init(self, params, cfg, batch: int, max_len: int, dtype, lengths_B) -> BoundedCache:
        if self.effective().budgets == "adakv":
            raise ValueError(f"policy {self.name!r}: Ada-KV budgets follow attention scores as they change; "
                             "a static-priority ranker's one-pass bounded prefill fixes every head's budget "
                             "first. Use Ada-KV with it under prefill compression (prompt_compressed), or "
                             "with an attention-statistic ranker (adakv = SnapKV's)")
        return super().init(params, cfg, batch, max_len, dtype, lengths_B)

    def _prefill(self, params, layer, q, k, v, positions, cache):
        ev, buf = self.effective(), cache.layers[layer]
        prio, state = self.prefill_priority(params, layer, k, v, positions, cache.lengths,
                                            self._policy_state(cache, layer))
        if ev.prefill == "chunked" and q.shape[1] > ev.prefill_chunk:
            out, buf = chunked_prefill(q, k, v, prio, cache.lengths, buf, ev, ev.prefill_chunk)
            return out, _replace(cache, layer, buf, state)
        out, _ = self.sparse_attention(q, k, v, prio, buf.budget)
        return out, _replace(cache, layer, prefill_buffer(buf, k, v, prio, cache.lengths, ev), state)

    def _decode(self, params, layer, q, k, v, positions, cache):
        ev, buf = self.effective(), cache.layers[layer]
        q_B = positions[:, 0]
        slot, present = exiting_slot(buf, q_B, ev)
        p_exit, state = self.exit_priority(params, layer, k[:, 0], v[:, 0], read_slot(buf.k, slot),
                                           read_slot(buf.v, slot), q_B - ev.window, self._policy_state(cache, layer))
        buf, target = place(buf, q_B, slot, present, p_exit, ev)
        buf = write(buf, target, k[:, 0], v[:, 0], q_B)
        out = pallas_kernels.sparse_decode(q[:, 0], buf.k.astype(q.dtype), buf.v.astype(q.dtype), buf.pos >= 0,
                                           backend=ev.kernel, interpret=ev.kernel_interpret)
        return out[:, None], _replace(cache, layer, buf, state)


@struct.dataclass
class SlotScores:
    """An attention-statistic policy's state: its statistic per slot ``[B, K, N]``."""

    score: jax.Array


@dataclasses.dataclass(frozen=True)
class AttentionStatistic(BoundedPolicy):
    """Protocol 2: a policy supplies its statistic after a dense prefill (``prefill_scores``)
    and its update from each decode step's attention (``update_scores``); ``rank`` turns the
    statistic into the buffer's long-range priorities (default: the statistic itself) and
    ``refresh`` runs after each step's update."""

    static: ClassVar[bool] = False

    score_rows: ClassVar[int | None] = None       # query rows the statistic reads: all, or each row's last R
    columnwise: ClassVar[bool] = False            # a key's score reads only its column (statistic_scores)
    needs_queries: ClassVar[bool] = True          # the statistic reads the prompt's queries (KeyDiff: keys only)

    def prefill_scores(self, probs_BKGRS, lengths_B, qpos_BR):
        """``[B, K, S]`` per-token statistic after a dense prefill, from the attention
        probabilities of the query rows at positions ``qpos [B, R]``
        (:func:`kvjax.eviction.attention.statistic_probs` with :attr:`score_rows`). Linear in
        the probabilities: with every row read, the rows come in blocks whose scores are summed
        (:func:`kvjax.eviction.attention.statistic_scores`)."""
        raise NotImplementedError(f"policy {self.name!r} defines no prefill_scores()")

    def prefill_statistic(self, q_BSHD, k_BSKD, lengths_B) -> jax.Array:
        """``float32 [B, K, S]``: the statistic of each prompt token (only ``t < n_b`` is used):
        :meth:`prefill_scores` over the attention of the rows it reads, in blocks. A statistic
        of the keys alone (KeyDiff) overrides this instead."""
        return statistic_scores(q_BSHD, k_BSKD, lengths_B, self.score_rows, self.prefill_scores,
                                columnwise=self.columnwise)

    def update_scores(self, scores_BKN, probs_BKN):
        """The per-slot statistic after one decode step's attention probabilities ``[B, K, N]``."""
        raise NotImplementedError(f"policy {self.name!r} defines no update_scores()")

    def rank(self, buf: SlotBuffer, state: SlotScores) -> SlotBuffer:
        """The buffer with this step's long-range priorities (default: the current statistic)."""
        return buf.replace(prio=state.score)

    def refresh(self, buf: SlotBuffer, state: SlotScores, q_B) -> tuple[SlotBuffer, SlotScores]:
        """Hook after each decode step's statistics update."""
        return buf, state

    def init_policy_state(self, params, cfg, batch: int):
        ev = self.effective()
        n = ev.sinks + ev.window + ev.slots
        return tuple(SlotScores(jnp.zeros((batch, cfg.num_kv_heads, n), jnp.float32)) for _ in range(cfg.num_layers))

    def reallocate(self, buf: SlotBuffer, q_B) -> SlotBuffer:
        """Ada-KV bounded throughout (``budgets="adakv"``): the layer's ``K topk`` long-range
        slots are one pool. After token ``q`` is written, the long-range tokens of all heads
        (each head's exiting token included, kept by :meth:`_decode` whatever its rank) are
        re-selected by their priorities (:func:`adakv_select`: each head its best
        ``floor(alpha topk)``, then the best of all); the rest are evicted. ``budget`` records
        each head's share (its count, plus an even share of unused slots)."""
        ev = self.effective()
        lr = (buf.pos >= ev.sinks) & (buf.pos <= (q_B - ev.window)[:, None, None])
        kept, budget = self._adakv_split(buf.prio, lr)
        return buf.replace(pos=jnp.where(lr & ~kept, -1, buf.pos), budget=budget)

    def _adakv_split(self, prio_BKN, candidate_BKN):
        """Ada-KV's kept candidates ``bool [B, K, N]`` at the uniform total ``K topk`` per row, and
        each head's resulting budget ``int32 [B, K]``."""
        ev = self.effective()
        n_top = jnp.full(prio_BKN.shape[:1], ev.topk, jnp.int32)
        kept = adakv_select(prio_BKN, candidate_BKN, n_top, ev.adakv_alpha)
        return kept, adakv_budgets(kept, n_top, ev.slots)

    def _prefill(self, params, layer, q, k, v, positions, cache):
        ev, buf = self.effective(), cache.layers[layer]
        out, _ = dense_attention(q, k, v, positions, positions, prefill=True)   # the prompt from position 0
        score = self.prefill_statistic(q, k, cache.lengths)
        if ev.budgets == "adakv":       # the prompt's candidates over all heads set each head's budget
            t = jnp.arange(score.shape[-1])[None, None, :]
            candidate = (t >= ev.sinks) & (t <= (cache.lengths - 1 - ev.window)[:, None, None])
            buf = buf.replace(budget=self._adakv_split(score, candidate)[1])
        buf = prefill_buffer(buf, k, v, score, cache.lengths, ev)
        return out, _replace(cache, layer, buf, SlotScores(gather_tokens(score, buf.pos)))

    def _decode(self, params, layer, q, k, v, positions, cache):
        ev, buf, state = self.effective(), cache.layers[layer], self._policy_state(cache, layer)
        q_B = positions[:, 0]
        buf = self.rank(buf, state)
        slot, present = exiting_slot(buf, q_B, ev)
        adakv = ev.budgets == "adakv"
        if adakv:                       # the exiting token stays (room up to k_max); the layer's pool decides
            buf = buf.replace(budget=jnp.full_like(buf.budget, ev.slots))
        buf, target = place(buf, q_B, slot, present, read_side(buf.prio, slot), ev)
        buf = write(buf, target, k[:, 0], v[:, 0], q_B)
        if adakv:
            buf = self.reallocate(buf, q_B)
        state = SlotScores(put_side(state.score, target, jnp.zeros(target.shape)))
        out, probs = slot_attention(q[:, 0], buf.k.astype(q.dtype), buf.v.astype(q.dtype), buf.pos >= 0)
        buf, state = self.refresh(buf, SlotScores(self.update_scores(state.score, probs.mean(axis=2))), q_B)
        return out[:, None], _replace(cache, layer, buf, state)
