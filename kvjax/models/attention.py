"""The attention function every layer calls (dense causal, plain XLA).

``softmax(q k^T / sqrt(D))`` over the keys a query may see: ``k_pos <= q_pos`` and
``k_valid``; grouped-query attention by viewing the ``Hq`` query heads as
``[Hkv, G]``. Softmax in float32; also returns the per-query log-sum-exp
(natural log of the softmax denominator) that the future-attention target reuses.
"""

from __future__ import annotations

from pallas_kernels.reference import grouped_attention


def dense_attention(q_BSHD, k_BTKD, v_BTKD, q_pos_BS, k_pos_BT, k_valid_BT=None, visible_BST=None,
                    kv_layout: str = "BTKD"):
    """Returns ``(out [B, S, Hq, D] in q's dtype, lse [B, S, Hq] float32)``; ``visible_BST``
    (optional bool ``[B, S, T]``, or ``[B, K, S, T]`` per KV head) further restricts which
    keys each query sees; ``kv_layout="BKTD"``: keys and values given as ``[B, K, T, D]``."""
    allowed_BST = k_pos_BT[:, None, :] <= q_pos_BS[:, :, None]
    if k_valid_BT is not None:
        allowed_BST = allowed_BST & k_valid_BT[:, None, :]
    allowed = allowed_BST[:, None, None]
    if visible_BST is not None:
        allowed = allowed & (visible_BST[:, None, None] if visible_BST.ndim == 3 else visible_BST[:, :, None])
    out, lse, _ = grouped_attention(q_BSHD, k_BTKD, v_BTKD, allowed=allowed, kv_layout=kv_layout)
    return out, lse
