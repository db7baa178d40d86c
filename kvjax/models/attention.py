"""The attention function every layer calls (dense causal, plain XLA).

``softmax(q k^T / sqrt(D))`` over the keys a query may see: ``k_pos <= q_pos`` and
``k_valid``; grouped-query attention by viewing the ``Hq`` query heads as
``[Hkv, G]``. Softmax in float32; also returns the per-query log-sum-exp
(natural log of the softmax denominator) that the future-attention target reuses.
"""

from __future__ import annotations

import jax.numpy as jnp

NEG_INF = -1e30


def dense_attention(q_BSHD, k_BTKD, v_BTKD, q_pos_BS, k_pos_BT, k_valid_BT=None, visible_BST=None):
    """Returns ``(out [B, S, Hq, D] in q's dtype, lse [B, S, Hq] float32)``; ``visible_BST``
    (optional bool ``[B, S, T]``, or ``[B, K, S, T]`` per KV head) further restricts which
    keys each query sees."""
    B, S, Hq, D = q_BSHD.shape
    K = k_BTKD.shape[2]
    G = Hq // K
    q = q_BSHD.reshape(B, S, K, G, D)
    logits_BKGST = jnp.einsum("bskgd,btkd->bkgst", q, k_BTKD,
                              preferred_element_type=jnp.float32) * (D ** -0.5)
    allowed_BST = k_pos_BT[:, None, :] <= q_pos_BS[:, :, None]
    if k_valid_BT is not None:
        allowed_BST = allowed_BST & k_valid_BT[:, None, :]
    allowed_BK1ST = allowed_BST[:, None, None]
    if visible_BST is not None:
        allowed_BK1ST = allowed_BK1ST & (visible_BST[:, None, None] if visible_BST.ndim == 3
                                         else visible_BST[:, :, None])
    logits_BKGST = jnp.where(allowed_BK1ST, logits_BKGST, NEG_INF)
    m = jnp.max(logits_BKGST, axis=-1, keepdims=True)
    p = jnp.exp(logits_BKGST - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgst,btkd->bskgd", (p / denom).astype(v_BTKD.dtype), v_BTKD,
                     preferred_element_type=jnp.float32)
    lse_BKGS = (m + jnp.log(denom))[..., 0]
    lse_BSH = jnp.transpose(lse_BKGS, (0, 3, 1, 2)).reshape(B, S, Hq)
    return out.reshape(B, S, Hq, D).astype(q_BSHD.dtype), lse_BSH
