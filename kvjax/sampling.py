"""Next-token choice: greedy, or sampling with temperature, top-k and top-p (nucleus).

The order is the one ``transformers`` applies: divide by the temperature, keep the
``top_k`` largest logits, then keep the smallest set of the rest whose probability
reaches ``top_p`` (the most likely token is always kept). All three knobs are traced
values, so changing them does not recompile.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def filter_logits(logits_BV: jax.Array, top_k, top_p) -> jax.Array:
    """``logits`` with every token outside the top-k / top-p set at ``-inf``.

    ``top_k <= 0`` and ``top_p >= 1`` switch the respective filter off.
    """
    V = logits_BV.shape[-1]
    desc = -jnp.sort(-logits_BV, axis=-1)                                       # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take(desc, k - 1, axis=-1)[:, None]                              # [B, 1]
    desc = jnp.where(desc >= kth, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs                           # mass of better tokens
    keep = (mass_before < top_p) | (jnp.arange(V) == 0)
    cut = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)      # smallest kept logit
    cut = jnp.where(top_p >= 1.0, kth, jnp.maximum(cut, kth))
    return jnp.where(logits_BV >= cut, logits_BV, -jnp.inf)


def sample_logits(logits_BV: jax.Array, key: jax.Array, temperature, top_k=0, top_p=1.0) -> jax.Array:
    """``int32 [B]``: argmax when ``temperature == 0``, else a draw from the filtered softmax."""
    temperature = jnp.asarray(temperature, jnp.float32)

    def draw(logits):
        scaled = logits / jnp.maximum(temperature, 1e-6)
        filtered = jax.lax.cond((top_k > 0) | (top_p < 1.0), lambda x: filter_logits(x, top_k, top_p),
                                lambda x: x, scaled)
        return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, draw, lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32), logits_BV)


def check_sampling(temperature, top_k, top_p) -> None:
    """Clear errors for sampling settings that would silently mean something else."""
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer (0 = off), got {top_k!r}")


def bucket(n: int, smallest: int = 32) -> int:
    """Round ``n`` up to one of 4 sizes per octave (at most 25% padding), so that prompts
    and generation lengths of many sizes share a bounded number of compiled programs."""
    if n <= smallest:
        return smallest
    step = 1 << max(0, (n - 1).bit_length() - 3)
    return -(-n // step) * step
