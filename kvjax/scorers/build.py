"""One constructor for KVpop's scorers, used by every place that makes one: ``distill_kvpop``'s
student, the scorer-only fits and the export loader (each learned policy's ``make_scorer``)."""

from __future__ import annotations

from flax import nnx

from kvjax.scorers.mlp import MLPScorer
from kvjax.scorers.mlstm import MLSTMScorer

SCORER_KINDS = ("mlp", "mlstm")


def make_scorer(kind: str, layers: int, kv_heads: int, head_dim: int, *, hidden: int = 0, qk_dim: int = 0,
                v_dim: int | None = None, readout_norm: bool = False, activation: str | None = None,
                seed: int = 0):
    """A fresh ``kind`` scorer (``"mlp"``: ``hidden`` units, ``activation``; ``"mlstm"``: ``qk_dim``,
    ``v_dim``, ``readout_norm``) for ``layers`` x ``kv_heads`` heads of ``head_dim``, its weights
    drawn from ``nnx.Rngs(seed)``."""
    rngs = nnx.Rngs(seed)
    if kind == "mlp":
        return MLPScorer(layers, kv_heads, head_dim, hidden, rngs=rngs,
                         **({"activation": activation} if activation is not None else {}))
    if kind == "mlstm":
        return MLSTMScorer(layers, kv_heads, head_dim, qk_dim, rngs=rngs, readout_norm=readout_norm,
                           **({"v_dim": v_dim} if v_dim is not None else {}))
    raise ValueError(f"scorer must be one of {', '.join(map(repr, SCORER_KINDS))}, got {kind!r}")
