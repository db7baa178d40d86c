"""LKV's training-time attention: the keep rule with a *soft* long-range selection.

Dimension letters: B batch, K KV heads, G query heads per KV head, S positions (queries
``q`` and keys ``t``), D head dim.

At inference head ``(l, h)`` keeps its sinks, its window and the top-``b_lh`` long-range
tokens by the LKV-T score ``u`` (the bounded cache's keep rule with per-head budgets).
In training the hard top-``b`` becomes the seed's Gumbel Soft-TopK, per query ``q`` over
the tokens eligible for the long-range slots, ``E(q) = {t : s <= t <= q - w}``:

    m~_{q,t} = ST_b((u_t + g_t) / tau)   restricted to E(q),   sum_{t in E(q)} m~_{q,t} = b,

with ``m~ = 1`` on sinks and the window, ``m~ = 1`` on all of ``E(q)`` while ``|E(q)| <= b``
(nothing to evict yet), and ``0`` above the diagonal. ``b = r_lh k_max`` is the *soft*
budget from LKV-H's ratios, so the KL reaches the head embeddings through ``b`` and the
token MLPs through ``u``. The mask multiplies the attention weights before normalisation
(the seed's multiplicative masking): ``a_{q,t} = m~_{q,t} exp(l_{q,t}) / sum_t' m~_{q,t'}
exp(l_{q,t'})``, computed as ``softmax(l + log m~)`` in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.eviction.attention import masked_attention
from kvjax.lkv.soft_topk import soft_topk

_FAR_BELOW = 1e4  # ineligible entries sit this far below the row's lowest score: ST ~ exp(-1e4) = 0


def soft_keep_weights(u_BKS: jax.Array, budget_BK: jax.Array, *, sinks: int, window: int, temperature,
                      noise_BKS: jax.Array | None = None) -> jax.Array:
    """Soft keep weights ``float32 [B, K, S(q), S(t)]`` in ``[0, 1]`` (module docstring).

    ``u`` token scores, ``budget`` the soft per-head budget ``b`` (``>= 0``), ``noise`` the
    Gumbel sample ``g`` (``None``: no noise, e.g. evaluation), ``temperature`` ``tau > 0``.
    """
    B, K, S = u_BKS.shape
    x_BKS = u_BKS.astype(jnp.float32) + (0.0 if noise_BKS is None else noise_BKS)
    q_Q1, t_1T = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    eligible_QT = (t_1T >= sinks) & (t_1T <= q_Q1 - window)
    n_elig_Q = jnp.sum(eligible_QT, axis=-1)
    floor_BK = jnp.min(x_BKS, axis=-1)[..., None, None] - _FAR_BELOW * jnp.maximum(1.0, temperature)
    x_BKQT = jnp.where(eligible_QT, x_BKS[:, :, None, :], floor_BK)
    b_BKQ = jnp.broadcast_to(budget_BK.astype(jnp.float32)[..., None], (B, K, S))
    full_BKQ = n_elig_Q <= b_BKQ                         # fewer candidates than slots: keep them all
    safe_b = jnp.clip(b_BKQ, 0.5, S - 0.5)               # a valid ST budget; rows where it differs are replaced
    soft_BKQT = soft_topk(x_BKQT, safe_b, temperature=temperature)
    long_BKQT = jnp.where(full_BKQ[..., None], 1.0, soft_BKQT)
    long_BKQT = jnp.where(b_BKQ[..., None] <= 0, 0.0, long_BKQT)
    always_QT = (t_1T <= q_Q1) & ((t_1T < sinks) | (t_1T > q_Q1 - window))
    return jnp.where(always_QT, 1.0, jnp.where(eligible_QT, long_BKQT, 0.0))


def soft_masked_attention(q_BSHD, k_BSKD, v_BSKD, weights_BKSS):
    """``out [B, S, H, D]``: attention with probabilities proportional to ``m~ exp(l)``."""
    log_w = jnp.log(jnp.maximum(weights_BKSS, 1e-30))
    return masked_attention(q_BSHD, k_BSKD, v_BSKD, weights_BKSS > 0, log_weights_BKSS=log_w)[0]
