"""What a ragged DMS cache would hold, measured: DMS frees a token's slot once its decision
says evict (``a_t > 0``) and the delay has passed, so each head's cache holds its sinks, its
window and the tokens it chose to keep -- a size that varies by head and by sequence. kvjax's
cache has one fixed budget per head, so it must be sized for the largest.
"""

from __future__ import annotations

import numpy as np

from kvjax.eviction.dms import dms_logits
from kvjax.models.decoder import causal_attention


def kept_fractions(model, policy, sequences, *, sinks: int, window: int) -> np.ndarray:
    """``float [N, L, K]``: per sequence, layer and KV head, the share of the evictable tokens
    (``sinks <= t < n - window``) whose decision is keep (``a_t <= 0``)."""
    import jax.numpy as jnp

    w, b = policy.weights(policy.params)

    def recording(layer, q, k, v, positions, acc):
        out, _ = causal_attention(layer, q, k, v, positions, None)
        return out, acc + (dms_logits(w[layer], b[layer], k, v),)

    rows = []
    for seq in sequences:
        n = len(seq)
        if n <= sinks + window:
            continue
        _, logits = model(jnp.asarray(np.asarray(seq, np.int32)[None]), None, recording, ())
        a = np.stack([np.asarray(x)[0] for x in logits])                    # [L, K, n]
        rows.append((a[:, :, sinks:n - window] <= 0).mean(-1))
    return np.asarray(rows)


def ragged_memory(fractions_NLK, lengths_N, *, sinks: int, window: int) -> dict:
    """Slots a ragged DMS cache needs against a fixed per-head budget, for the sequences measured:
    ``mean_slots`` (the average head and sequence), ``max_slots`` (the fullest head of any
    sequence: what a fixed budget must hold to never evict a kept token) and their ratio."""
    n = np.asarray(lengths_N, np.float64)[:, None, None]
    slots = sinks + window + fractions_NLK * (n - sinks - window)
    return {"mean_slots": float(slots.mean()), "max_slots": float(slots.max()),
            "mean_kept_fraction": float(fractions_NLK.mean()),
            "fixed_over_ragged": float(slots.max() / slots.mean())}
