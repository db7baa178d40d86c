"""KeyDiff (Park et al. 2025, arXiv:2504.15364): keep the keys least like the head's mean key.

Per KV head, the anchor is the mean of the *normalised* keys and a token's score is

    s_t = -cos(k_t, a),    a = mean_t k_t / ||k_t||,

so the most distinctive keys (largest angle to the anchor) are kept. KeyDiff reads keys only,
no attention: it needs no query and works with any attention kernel.

Which protocol: the anchor moves as tokens come and go, so a token's priority is not fixed once
it exists; KeyDiff is an :class:`~kvjax.eviction.bounded.AttentionStatistic` whose statistic is
a function of the keys, not of attention:

- prefill compression (kvpress's setting) and a bounded prefill: the anchor is the mean over the
  prompt's (the context's) ``n_b`` tokens, and the context is ranked once by ``s_t``;
- bounded throughout: before each decode step every slot is re-ranked against the mean over the
  cache's current slots (sinks, window and long-range alike), as kvpress's block and decoding
  presses re-score the cache they hold; the token leaving the window competes with that score.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache.slots import SlotBuffer
from kvjax.eviction.bounded import AttentionStatistic, SlotScores
from kvjax.eviction.registry import register


def keydiff_scores(k_BKTD, valid_BKT) -> jax.Array:
    """``float32 [B, K, T]``: ``-cos(k_t, a)`` with ``a`` the mean normalised key over the valid
    entries of each row and head (invalid entries are scored too, against the same anchor)."""
    k = k_BKTD.astype(jnp.float32)
    unit = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    w = valid_BKT.astype(jnp.float32)[..., None]
    anchor = jnp.sum(unit * w, axis=2) / jnp.maximum(jnp.sum(w, axis=2), 1.0)              # [B, K, D]
    anchor = anchor / jnp.maximum(jnp.linalg.norm(anchor, axis=-1, keepdims=True), 1e-12)
    return -jnp.einsum("bktd,bkd->bkt", unit, anchor)


@register
@dataclasses.dataclass(frozen=True)
class KeyDiff(AttentionStatistic):
    """``keydiff``: see the module docstring."""

    name: ClassVar[str] = "keydiff"
    needs_queries: ClassVar[bool] = False          # the anchor and the cosines are the keys' own

    def prefill_statistic(self, q_BSHD, k_BSKD, lengths_B) -> jax.Array:
        k = jnp.swapaxes(k_BSKD, 1, 2)                                                     # [B, K, S, D]
        valid = jnp.arange(k.shape[2])[None, None, :] < lengths_B[:, None, None]
        return keydiff_scores(k, jnp.broadcast_to(valid, k.shape[:3]))

    def update_scores(self, scores_BKN, probs_BKN):
        return scores_BKN                       # the keys, not attention, decide (see rank)

    def rank(self, buf: SlotBuffer, state: SlotScores) -> SlotBuffer:
        """Every slot against the mean normalised key of the slots held now."""
        return buf.replace(prio=keydiff_scores(buf.k, buf.pos >= 0))
