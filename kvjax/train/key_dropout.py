"""Key dropout: pretraining under random permanent eviction.

A teacher that will be served with a bounded cache should not lean on tokens it does
not need. Measured on the testbed teacher trained densely: evicting a random 12% of
the keys outside an 8-token window (448 of ~510 kept) dropped its copies of the query's
names in the answer line from 100% to 61%, so circuits read diffuse context that no
eviction policy can keep. Key dropout trains against that: in every layer, each key is
dropped for all later queries (as an evicted token is) with probability ``rate``,
except the first ``sinks`` positions and the ``window`` most recent keys of each query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.models.attention import dense_attention


def key_dropout_attention(key: jax.Array, rate, window: int, sinks: int = 1):
    """A decoder attention backend (``(layer, q, k, v, positions, state) -> (out, state)``)
    with key dropout at ``rate`` (a scalar, may be traced); ``rate = 0`` is causal attention."""
    if window < 1:
        raise ValueError(f"key dropout window must be >= 1, got {window}")

    def backend(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, state):
        B, S = positions_BS.shape
        dropped_BS = jax.random.bernoulli(jax.random.fold_in(key, layer), rate, (B, S))
        age_BSS = positions_BS[:, :, None] - positions_BS[:, None, :]
        visible = (~dropped_BS[:, None, :]) | (age_BSS < window) | (positions_BS[:, None, :] < sinks)
        out, _ = dense_attention(q_BSHD, k_BSKD, v_BSKD, positions_BS, positions_BS, visible_BST=visible)
        return out, state

    return backend


def rate_at(rates: list[float], phase_steps: list[int], step):
    """The key dropout rate of the phase holding (traced) ``step``."""
    bounds = jnp.cumsum(jnp.asarray(phase_steps[:-1], jnp.int32))
    return jnp.asarray(rates, jnp.float32)[jnp.searchsorted(bounds, step, side="right")]
