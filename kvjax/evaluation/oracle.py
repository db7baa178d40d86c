"""Oracle priorities: the dense teacher's future-attention target per layer (in hindsight)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.models.attention import dense_attention
from kvjax.targets import future_attention_target


@functools.partial(jax.jit, static_argnums=(0, 3))
def _oracle(graphdef, params, tokens_BS, window: int):
    model = nnx.merge(graphdef, params)

    def capture(layer, q, k, v, positions, targets):
        out, lse = dense_attention(q, k, v, positions, positions)
        tgt = future_attention_target(q, k, window=window, lse=lse)
        # tokens with no future query rank by recency (they sit in the window anyway)
        t = jnp.arange(q.shape[1], dtype=jnp.float32)
        tgt = jnp.where(jnp.isfinite(tgt), tgt, -1e9 + t)
        return out, targets + (tgt,)

    _, targets = model(tokens_BS, None, capture, ())
    return jnp.stack(targets)


def oracle_priorities(model, tokens_BS, window: int):
    """``float32 [L, B, K, S]``: log future attention mass under the dense teacher."""
    graphdef, params = nnx.split(model)
    return _oracle(graphdef, params, jnp.asarray(tokens_BS, jnp.int32), int(window))
