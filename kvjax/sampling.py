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


CANDIDATES = 256   # top-k/top-p look at this many best logits first; a full sort only when they do not suffice


def _filter_sorted(logits_BV, desc_BC, log_z_all_B1, top_k, top_p):
    """The top-k / top-p filter given the ``C`` best logits in descending order and the log
    partition function of all logits; exact when the kept set lies within those ``C``."""
    C = desc_BC.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, C), C)
    kth = jnp.take(desc_BC, k - 1, axis=-1)[:, None]                            # [B, 1]
    desc = jnp.where(desc_BC >= kth, desc_BC, -jnp.inf)
    log_z = jnp.where(top_k > 0, jax.nn.logsumexp(desc, -1, keepdims=True), log_z_all_B1)
    probs = jnp.exp(desc - log_z)                                              # of the top-k distribution
    mass_before = jnp.cumsum(probs, axis=-1) - probs                           # mass of better tokens
    keep = (mass_before < top_p) | (jnp.arange(C) == 0)
    cut = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)      # smallest kept logit
    floor = jnp.where(top_k > 0, kth, -jnp.inf)
    cut = jnp.where(top_p >= 1.0, floor, jnp.maximum(cut, floor))
    return jnp.where(logits_BV >= cut, logits_BV, -jnp.inf)


def filter_logits(logits_BV: jax.Array, top_k, top_p) -> jax.Array:
    """``logits`` with every token outside the top-k / top-p set at ``-inf``.

    ``top_k <= 0`` and ``top_p >= 1`` switch the respective filter off. The kept set is
    found among the ``CANDIDATES`` best logits (``lax.top_k``, ~50x cheaper than sorting a
    49k vocabulary on a CPU); when it may reach past them (``top_k`` larger, or less than
    ``top_p`` of the mass within them) the whole vocabulary is sorted instead.
    """
    V = logits_BV.shape[-1]
    C = min(V, CANDIDATES)
    top_C = jax.lax.top_k(logits_BV, C)[0]                                      # [B, C] descending
    log_z_all = jax.nn.logsumexp(logits_BV, -1, keepdims=True)
    k_in = (top_k > 0) & (top_k <= C)
    within = jnp.all(jnp.sum(jnp.exp(top_C - log_z_all), -1) >= top_p)          # the top-p cut lies inside C
    fits = (C == V) | k_in | ((top_k <= 0) & (within | (top_p >= 1.0)))
    return jax.lax.cond(fits, lambda x: _filter_sorted(x, top_C, log_z_all, top_k, top_p),
                        lambda x: _filter_sorted(x, -jnp.sort(-x, axis=-1), log_z_all, top_k, top_p), logits_BV)


def sample_logits(logits_BV: jax.Array, key: jax.Array, temperature, top_k=0, top_p=1.0) -> jax.Array:
    """``int32 [B]``: argmax when ``temperature == 0``, else a draw from the filtered softmax.

    ``key`` is one key for the batch, or ``[B]`` keys, one per row (a row's draw then does
    not depend on the other rows).
    """
    temperature = jnp.asarray(temperature, jnp.float32)

    def draw(logits):
        scaled = logits / jnp.maximum(temperature, 1e-6)
        filtered = jax.lax.cond((top_k > 0) | (top_p < 1.0), lambda x: filter_logits(x, top_k, top_p),
                                lambda x: x, scaled)
        if key.ndim == 1:
            return jax.vmap(lambda k, x: jax.random.categorical(k, x))(key, filtered).astype(jnp.int32)
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
