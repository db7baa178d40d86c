"""The one mechanism every eviction policy runs on: a bounded cache (one
:class:`LayerState` per layer) with a prefill backend (keep-rule masked attention for
static priorities, dense attention + selection for attention heuristics) and a decode
backend (exiting token competes for the long-range slots, then attention over slots).

A policy subclasses :class:`BoundedPolicy` and supplies priorities only. It is a frozen
(hashable) dataclass, so ``jax.jit`` treats it as static; its arrays (scorer weights,
oracle priorities) travel separately as ``params``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.eviction.attention import causal_probs, slot_attention
from kvjax.eviction.fenwick import cutoffs_from_ranks, token_ranks
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.state import (LayerState, all_slots, exiting, init_layer, insert_long_range, prefill_layer,
                                  set_scores, slot_positions, write_current)
from kvjax.models.attention import dense_attention


@struct.dataclass
class BoundedCache:
    layers: tuple[LayerState, ...]
    lengths: jax.Array        # [B] prompt lengths (read by prefill)
    aux: tuple = ()           # per-layer policy state (e.g. the mLSTM scorer's memory)

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


@dataclasses.dataclass(frozen=True)
class BoundedPolicy:
    config: EvictionConfig = dataclasses.field(default_factory=EvictionConfig)
    params: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    # (layers, KV heads, head_dim, config sha256 or None) of the model learned weights were made for
    fits: tuple | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    name: ClassVar[str] = "bounded"
    static: ClassVar[bool] = True     # priorities fixed per token (keep-rule path)

    # ---- what a policy supplies -------------------------------------------------------
    def effective(self) -> EvictionConfig:
        """The budget this policy actually runs with."""
        return self.config

    def priority(self, params, layer: int, k_BSKD, v_BSKD, t_BS):
        """Static policies: ``float32 [B, K, S]`` priority of tokens at positions ``t``."""
        raise TypeError(f"policy {self.name!r} is static but defines no priority()")

    def prefill_scores(self, probs_BKGSS, lengths_B):
        """Attention heuristics: ``[B, K, S]`` per-token statistic after a dense prefill."""
        raise TypeError(f"policy {self.name!r} is not static but defines no prefill_scores()")

    def update_scores(self, scores_BKN, probs_BKN):
        """Attention heuristics: new per-slot statistic after one decode step."""
        raise TypeError(f"policy {self.name!r} is not static but defines no update_scores()")

    def decode_priorities(self, st: LayerState, exit_score_BK, exit_snapshot_BK):
        """Attention heuristics: the exiting token's priority, and the state with its
        long-range priorities for this step (default: the current statistic)."""
        return exit_score_BK, st.replace(lr_prio=st.lr_score)

    def refresh(self, st: LayerState, q_B) -> LayerState:
        """Attention heuristics: hook after each decode step's statistics update."""
        return st

    def init_aux(self, params, cfg, batch: int):
        """Per-layer policy state carried in the cache (default: none)."""
        return ()

    def prefill_priority(self, params, layer: int, k_BSKD, v_BSKD, positions_BS, lengths_B, aux):
        """Static policies: prompt priorities ``[B, K, S]`` and this layer's policy state."""
        return self.priority(params, layer, k_BSKD, v_BSKD, positions_BS), aux

    def exit_priority(self, params, layer: int, k_new_BKD, v_new_BKD, k_exit_BKD, v_exit_BKD, t_B, aux):
        """Static policies: priority ``[B, K]`` of the token leaving the window (after the
        current token ``q`` arrived) and this layer's policy state."""
        return self.priority(params, layer, k_exit_BKD[:, None], v_exit_BKD[:, None], t_B[:, None])[:, :, 0], aux

    def head_budgets(self, params, cfg, batch: int):
        """``int32 [L, B, K]`` long-range slots each head may fill (default: ``topk``)."""
        ev = self.effective()
        return jnp.full((cfg.num_layers, batch, cfg.num_kv_heads), ev.topk, jnp.int32)

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
            from kvjax.export import config_hash

            if config_hash(cfg) != digest:
                import warnings

                warnings.warn(f"policy {self.name!r}: the model's config differs from the one its scorers were "
                              "exported with (same shapes); check that they belong together", stacklevel=3)

    # ---- the shared mechanism ------------------------------------------------------------
    def with_params(self, params) -> "BoundedPolicy":
        return dataclasses.replace(self, params=params)

    def init(self, params, cfg, batch: int, max_len: int, dtype, lengths_B) -> BoundedCache:
        ev = self.effective()
        ev.check_fits(cfg.max_position_embeddings)
        budgets = self.head_budgets(params, cfg, batch)
        layers = tuple(init_layer(ev, batch, cfg.num_kv_heads, cfg.head_dim, dtype, budgets[i])
                       for i in range(cfg.num_layers))
        return BoundedCache(layers, jnp.asarray(lengths_B, jnp.int32), self.init_aux(params, cfg, batch))

    def sparse_attention(self, q_BSHD, k_BSKD, v_BSKD, prio_BKS, budget_BK):
        """Keep-rule attention from static priorities, each head with its own long-range budget
        (the decode state's, so prefill and decode keep the same set), by the configured kernel."""
        import pallas_kernels

        ev = self.effective()
        rank = token_ranks(prio_BKS)
        cut = cutoffs_from_ranks(rank, sinks=ev.sinks, window=ev.window, topk=budget_BK)
        return pallas_kernels.sparse_attention(q_BSHD, k_BSKD, v_BSKD, rank, cut, sinks=ev.sinks, window=ev.window,
                                               backend=ev.kernel, interpret=ev.kernel_interpret)

    def backend(self, params, layer: int, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache: BoundedCache):
        if q_BSHD.shape[1] > 1:
            return self._prefill(params, layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache)
        return self._decode(params, layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, cache)

    def _prefill(self, params, layer, q, k, v, positions, cache):
        ev, st = self.effective(), cache.layers[layer]
        if self.static:
            aux = cache.aux[layer] if cache.aux else None
            prio, aux = self.prefill_priority(params, layer, k, v, positions, cache.lengths, aux)
            cache = _replace_aux(cache, layer, aux)
            out, _ = self.sparse_attention(q, k, v, prio, st.budget)
            score = jnp.zeros_like(prio)
        else:
            out, _ = dense_attention(q, k, v, positions, positions)
            prio = score = self.prefill_scores(causal_probs(q, k), cache.lengths)
        st = prefill_layer(st, k, v, prio, score, cache.lengths, ev)
        return out, _replace_layer(cache, layer, st)

    def _decode(self, params, layer, q, k, v, positions, cache):
        ev, st = self.effective(), cache.layers[layer]
        q_B = positions[:, 0]
        ex_k, ex_v, t_B, valid_B, ex_score, ex_snap = exiting(st, q_B, ev)
        if self.static:
            aux = cache.aux[layer] if cache.aux else None
            p_exit, aux = self.exit_priority(params, layer, k[:, 0], v[:, 0], ex_k, ex_v, t_B, aux)
            cache = _replace_aux(cache, layer, aux)
        else:
            p_exit, st = self.decode_priorities(st, ex_score, ex_snap)
        st = insert_long_range(st, ex_k, ex_v, t_B, valid_B, p_exit, ex_score)
        st = write_current(st, k[:, 0], v[:, 0], q_B, ev)
        keys, vals, scores = all_slots(st)
        valid = slot_positions(st, q_B, ev) >= 0
        if self.static:      # priorities need no attention statistics: the decode kernel
            import pallas_kernels

            out = pallas_kernels.sparse_decode(q[:, 0], keys.astype(q.dtype), vals.astype(q.dtype), valid,
                                               backend=ev.kernel, interpret=ev.kernel_interpret)
            return out[:, None], _replace_layer(cache, layer, st)
        out, probs = slot_attention(q[:, 0], keys.astype(q.dtype), vals.astype(q.dtype), valid)
        st = self.refresh(set_scores(st, self.update_scores(scores, probs.mean(axis=2)), ev), q_B)
        return out[:, None], _replace_layer(cache, layer, st)


def _replace_aux(cache: BoundedCache, layer: int, aux) -> BoundedCache:
    if not cache.aux:
        return cache
    return cache.replace(aux=cache.aux[:layer] + (aux,) + cache.aux[layer + 1:])


def _replace_layer(cache: BoundedCache, layer: int, st: LayerState) -> BoundedCache:
    return cache.replace(layers=cache.layers[:layer] + (st,) + cache.layers[layer + 1:])
