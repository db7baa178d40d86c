"""Oracle priorities: the dense teacher's future attention per layer, in hindsight.

``kind="mean"``: KVpop's training target (mean future attention mass, the seed's
Figure 7 oracle). ``kind="peak"``: the largest attention any single future query
pays the token (:func:`kvjax.targets.peak_future_attention`). ``kind="union"``: the
larger of the token's two percentile ranks (among the tokens with a future), so a token
is kept when either ranking wants it.

Measured on testbed teachers (256 tokens, 75% compression, 100 problems): the mean
keeps the recent structure an answer line copies from but loses far facts read once
(far lookups 60% vs dense 93%); the peak keeps the far facts (92%) but not that
structure (answers 30% vs 71%); the union keeps both better (91%, answers 50%).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.models.attention import dense_attention
from kvjax.targets import future_attention_target, peak_future_attention

KINDS = ("mean", "peak", "union")


def _percentile(x_BKS):
    """Rank of each finite entry among the finite ones of its row, in [0, 1)."""
    finite = jnp.isfinite(x_BKS)
    ranks = jnp.argsort(jnp.argsort(jnp.where(finite, x_BKS, -jnp.inf), axis=-1), axis=-1)
    missing = jnp.sum(~finite, axis=-1, keepdims=True)
    return (ranks - missing).astype(jnp.float32) / x_BKS.shape[-1]


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _oracle(graphdef, params, tokens_BS, window: int, kind: str, lengths_B=None):
    model = nnx.merge(graphdef, params)

    def capture(layer, q, k, v, positions, targets):
        out, lse = dense_attention(q, k, v, positions, positions, prefill=True)   # from position 0: query blocks
        if kind == "peak":
            tgt = peak_future_attention(q, k, window=window, lse=lse, lengths_B=lengths_B)
        elif kind == "mean":
            tgt = future_attention_target(q, k, window=window, lse=lse, lengths_B=lengths_B)
        else:
            peak = peak_future_attention(q, k, window=window, lse=lse, lengths_B=lengths_B)
            mean = future_attention_target(q, k, window=window, lse=lse, lengths_B=lengths_B)
            tgt = jnp.where(jnp.isfinite(mean), jnp.maximum(_percentile(peak), _percentile(mean)), -jnp.inf)
        # tokens with no future query rank by recency (they sit in the window anyway)
        t = jnp.arange(q.shape[1], dtype=jnp.float32)
        tgt = jnp.where(jnp.isfinite(tgt), tgt, -1e6 + t)   # exact integers in float32
        return out, targets + (tgt,)

    _, targets = model(tokens_BS, None, capture, ())
    return jnp.stack(targets)


def oracle_priorities(model, tokens_BS, window: int, kind: str = "mean", lengths_B=None):
    """``float32 [L, B, K, S]``: the dense teacher's log future attention (``kind`` above).
    ``lengths_B``: rows padded on the right count only their first ``lengths_B[b]`` queries."""
    if kind not in KINDS:
        raise ValueError(f"oracle kind must be one of {KINDS}, got {kind!r}")
    graphdef, params = nnx.split(model)
    lengths = None if lengths_B is None else jnp.asarray(lengths_B, jnp.int32)
    return _oracle(graphdef, params, jnp.asarray(tokens_BS, jnp.int32), int(window), kind, lengths)
