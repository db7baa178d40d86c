"""Oracle priorities: the dense teacher's future attention per layer, in hindsight.

``kind="mean"``: KVpop's training target (mean future attention mass, the seed's
Figure 7 oracle). ``kind="peak"``: the largest attention any single future query
pays the token (:func:`kvjax.targets.peak_future_attention`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.models.attention import dense_attention
from kvjax.targets import future_attention_target, peak_future_attention

KINDS = ("mean", "peak")


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _oracle(graphdef, params, tokens_BS, window: int, kind: str):
    model = nnx.merge(graphdef, params)

    def capture(layer, q, k, v, positions, targets):
        out, lse = dense_attention(q, k, v, positions, positions)
        if kind == "peak":
            tgt = peak_future_attention(q, k, window=window, lse=lse)
        else:
            tgt = future_attention_target(q, k, window=window, lse=lse)
        # tokens with no future query rank by recency (they sit in the window anyway)
        t = jnp.arange(q.shape[1], dtype=jnp.float32)
        tgt = jnp.where(jnp.isfinite(tgt), tgt, -1e9 + t)
        return out, targets + (tgt,)

    _, targets = model(tokens_BS, None, capture, ())
    return jnp.stack(targets)


def oracle_priorities(model, tokens_BS, window: int, kind: str = "mean"):
    """``float32 [L, B, K, S]``: the dense teacher's log future attention (``kind`` above)."""
    if kind not in KINDS:
        raise ValueError(f"oracle kind must be one of {KINDS}, got {kind!r}")
    graphdef, params = nnx.split(model)
    return _oracle(graphdef, params, jnp.asarray(tokens_BS, jnp.int32), int(window), kind)
