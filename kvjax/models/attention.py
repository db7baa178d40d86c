"""The attention function every layer calls (dense causal, plain XLA).

``softmax(q k^T / sqrt(D))`` over the keys a query may see: ``k_pos <= q_pos`` and
``k_valid``; grouped-query attention by viewing the ``Hq`` query heads as
``[Hkv, G]``. Softmax in float32; also returns the per-query log-sum-exp
(natural log of the softmax denominator) that the future-attention target reuses.
"""

from __future__ import annotations

from pallas_kernels.reference import causal_attention, grouped_attention


def dense_attention(q_BSHD, k_BTKD, v_BTKD, q_pos_BS, k_pos_BT, k_valid_BT=None, visible_BST=None,
                    kv_layout: str = "BTKD", prefill: bool = False):
    """Returns ``(out [B, S, Hq, D] in q's dtype, lse [B, S, Hq] float32)``; ``visible_BST``
    (optional bool ``[B, S, T]``, or ``[B, K, S, T]`` per KV head) further restricts which
    keys each query sees; ``kv_layout="BKTD"``: keys and values given as ``[B, K, T, D]``.

    ``prefill``: query ``s`` is the token at key index ``s`` and positions grow along the
    sequence (a prompt from its first position, or a training sequence), so no query sees a
    later index; attention then runs in query blocks that skip the keys past each block
    (:func:`pallas_kernels.reference.causal_attention`: the same results, about half the work
    and small blocks instead of ``S x T`` arrays), and keys past index ``S`` are ignored."""
    def allowed(rows=slice(None), keys=slice(None)):
        a = k_pos_BT[:, None, keys] <= q_pos_BS[:, rows, None]
        if k_valid_BT is not None:
            a = a & k_valid_BT[:, None, keys]
        a = a[:, None, None]
        if visible_BST is not None:
            vis = visible_BST[..., rows if visible_BST.shape[-2] > 1 else slice(None),
                              keys if visible_BST.shape[-1] > 1 else slice(None)]      # broadcast axes stay
            a = a & (vis[:, None, None] if vis.ndim == 3 else vis[:, :, None])
        return a

    if prefill:
        return causal_attention(q_BSHD, k_BTKD, v_BTKD, allowed=lambda s0, e: allowed(slice(s0, e), slice(0, e)),
                                kv_layout=kv_layout)
    out, lse, _ = grouped_attention(q_BSHD, k_BTKD, v_BTKD, allowed=allowed(), kv_layout=kv_layout)
    return out, lse
