"""XLA references of the three ops: the ground truth every kernel is tested against, and
the CPU path of ``backend="auto"``. Self-contained (no ``kvjax`` import); ``kvjax`` builds
its attention and its future-attention target on :func:`grouped_attention` and
:func:`future_log_mass`.

Layouts (the op API's): ``q [B, S, H, D]``, ``k, v [B, S, K, D]`` with ``H = G K``;
``rank, cutoff [B, K, S]`` (0 = best token; the running top-k threshold per query).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.keep_rule import dense_keep_mask

NEG_INF = -1e30


def grouped_logits(q_BSHD, k, *, kv_layout: str = "BTKD"):
    """``float32 [B, K, G, S, T]``: ``q k^T / sqrt(D)`` with the ``H = K G`` query heads grouped
    by KV head; ``k`` laid out as in :func:`grouped_attention`."""
    B, S, H, D = q_BSHD.shape
    K = k.shape[2] if kv_layout == "BTKD" else k.shape[1]
    kv = {"BTKD": "btkd", "BKTD": "bktd"}[kv_layout]
    q = q_BSHD.reshape(B, S, K, H // K, D)
    return jnp.einsum(f"bskgd,{kv}->bkgst", q, k, preferred_element_type=jnp.float32) * D ** -0.5


def grouped_attention(q_BSHD, k, v, *, allowed=None, log_weights=None, kv_layout: str = "BTKD"):
    """Grouped-query softmax attention, the one XLA formulation behind every reference.

    ``k``, ``v``: ``[B, T, K, D]`` (``kv_layout="BTKD"``) or ``[B, K, T, D]`` (``"BKTD"``, the
    bounded cache's slot buffer). ``allowed`` (bool) and ``log_weights`` (float, added to the
    logits: a multiplicative mask on the weights) broadcast to ``[B, K, G, S, T]``.
    Returns ``(out [B, S, H, D] in q's dtype, lse [B, S, H] float32, probs [B, K, G, S, T] float32)``.
    """
    B, S, H, D = q_BSHD.shape
    kv = {"BTKD": "btkd", "BKTD": "bktd"}[kv_layout]
    logits = grouped_logits(q_BSHD, k, kv_layout=kv_layout)
    if log_weights is not None:
        logits = logits + log_weights
    if allowed is not None:
        logits = jnp.where(allowed, logits, NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # normalised after the value product (over D, not T) and laid out [B, K, G, S, D] until the
    # end: 2.7x faster than weights @ values in [B, S, K, G, D] for one query over 2k slots, CPU
    out = jnp.einsum(f"bkgst,{kv}->bkgsd", p.astype(v.dtype), v, preferred_element_type=jnp.float32) / denom
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, S, H, D)
    lse = jnp.transpose((m + jnp.log(denom))[..., 0], (0, 3, 1, 2)).reshape(B, S, H)
    return out.astype(q_BSHD.dtype), lse, p / denom


CAUSAL_BLOCK = 128      # query rows per block of causal_attention (fastest of 64-512 on 2 CPU cores)


def causal_attention(q_BSHD, k, v, *, allowed, kv_layout: str = "BTKD", block: int = CAUSAL_BLOCK):
    """:func:`grouped_attention` of a causal prefill, in query blocks: ``(out, lse)``.

    Query ``s`` is the token at key index ``s``, and ``allowed`` hides every key ``t > s``
    (it may hide more). Query block ``[s0, e)`` then reads keys ``[0, e)`` only: the logits
    above the diagonal's blocks are never formed (about half of ``S x S``), and each block's
    ``[B, K, G, block, e]`` arrays stay small. Keys past index ``S`` are ignored. The results
    equal :func:`grouped_attention`'s; the skipped logits would only have added zero weights.

    ``allowed``: a callable ``(s0, e) -> bool`` mask broadcastable to ``[B, K, G, e - s0, e]``
    (the rows and keys of one block), so an ``S x S`` mask is never built whole.
    """
    S = q_BSHD.shape[1]
    outs, lses = [], []
    for s0 in range(0, S, block):
        e = min(S, s0 + block)
        kb, vb = (k[:, :e], v[:, :e]) if kv_layout == "BTKD" else (k[:, :, :e], v[:, :, :e])
        out, lse, _ = grouped_attention(q_BSHD[:, s0:e], kb, vb, allowed=allowed(s0, e), kv_layout=kv_layout)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


DECODE_BLOCK = 1024     # keys per block of prefix_attention (512-2048 measured within 15% at 8k on 2 CPU cores)


def prefix_attention(q_BSHD, k_BKTD, v_BKTD, q_pos_BS, *, block: int = DECODE_BLOCK):
    """Causal attention of a few queries over a slot-indexed cache (slot ``t`` holds position
    ``t``; query ``(b, s)`` sees slots ``t <= q_pos_BS[b, s]``), reading only the blocks up to the
    furthest query: ``(out [B, S, H, D] in q's dtype, lse [B, S, H] float32)``.

    The decode step of a dense cache allocated for the whole generation: a ``lax.fori_loop`` over
    ``ceil((max q_pos + 1) / block)`` key blocks with the online softmax
    ``m' = max(m, max_t s_t)``, ``l' = l e^{m - m'} + sum_t e^{s_t - m'}``,
    ``acc' = acc e^{m - m'} + sum_t e^{s_t - m'} v_t``, ``out = acc / l``, so a step at position
    ``p`` costs ``O(p)``, not the allocated ``O(T)``. Equal to :func:`grouped_attention` with the
    causal mask up to float rounding (tested). The last block is read at ``T - block`` when ``T``
    is not a multiple of ``block``, its slots before ``i * block`` masked (already counted). When
    the blocks to read cover more than half the cache, one pass over all of it is cheaper than
    the loop's block copies and is taken instead (``lax.cond``)."""
    B, S, H, D = q_BSHD.shape
    K, T = k_BKTD.shape[1], k_BKTD.shape[2]
    G, blk = H // K, min(block, T)
    n = jnp.minimum((jnp.max(q_pos_BS) + blk) // blk, -(-T // blk))

    def body(i, carry):
        m, l, acc = carry
        start = jnp.minimum(i * blk, T - blk)
        kb = jax.lax.dynamic_slice_in_dim(k_BKTD, start, blk, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(v_BKTD, start, blk, axis=2)
        idx = start + jnp.arange(blk)
        ok = ((idx >= i * blk)[None, None, :] & (idx[None, None, :] <= q_pos_BS[:, :, None]))[:, None, None]
        s = jnp.where(ok, grouped_logits(q_BSHD, kb, kv_layout="BKTD"), NEG_INF)          # [B, K, G, S, blk]
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        acc = acc * scale[..., None] + jnp.einsum("bkgst,bktd->bkgsd", p.astype(vb.dtype), vb,
                                                  preferred_element_type=jnp.float32)
        return m_new, l * scale + jnp.sum(p, axis=-1), acc

    def blocks(q, k, v, q_pos):
        init = (jnp.full((B, K, G, S), NEG_INF, jnp.float32), jnp.zeros((B, K, G, S), jnp.float32),
                jnp.zeros((B, K, G, S, D), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, n, body, init)
        out = jnp.transpose(acc / l[..., None], (0, 3, 1, 2, 4)).reshape(B, S, H, D)
        return out.astype(q.dtype), jnp.transpose(m + jnp.log(l), (0, 3, 1, 2)).reshape(B, S, H)

    def whole(q, k, v, q_pos):
        causal = (jnp.arange(T)[None, None, :] <= q_pos[:, :, None])[:, None, None]
        return grouped_attention(q, k, v, allowed=causal, kv_layout="BKTD")[:2]

    # past half the cache one pass is cheaper than the loop's block copies (measured, 2 CPU cores)
    return jax.lax.cond(2 * n * blk > T, whole, blocks, q_BSHD, k_BKTD, v_BKTD, q_pos_BS)


def sparse_attention(q_BSHD, k_BSKD, v_BSKD, rank_BKS, cutoff_BKS, *, sinks: int, window: int):
    """``(out [B, S, H, D], lse [B, S, H] float32)``: causal attention under the keep rule
    (:func:`~pallas_kernels.keep_rule.dense_keep_mask`, built one query block at a time)."""
    def allowed(s0, e):
        return dense_keep_mask(rank_BKS[..., :e], cutoff_BKS[..., s0:e], sinks, window, first_row=s0)[:, :, None]

    return causal_attention(q_BSHD, k_BSKD, v_BSKD, allowed=allowed)


def sparse_decode(q_BHD, k_BKND, v_BKND, valid_BKN):
    """One decode step over the bounded cache's slots: ``out [B, H, D]``."""
    out, _, _ = grouped_attention(q_BHD[:, None], k_BKND, v_BKND, allowed=valid_BKN[:, :, None, None],
                                  kv_layout="BKTD")
    return out[:, 0]


def _valid_length(S: int, lengths_B):
    """``[B or 1, 1]`` query count of each row: its length, or ``S`` (rows padded on the right)."""
    return jnp.full((1, 1), S) if lengths_B is None else jnp.asarray(lengths_B)[:, None]


@functools.partial(jax.jit, static_argnames=("window", "block", "reduce", "segments"))
def future_log_mass(q_BSHD, k_BSKD, *, window: int, lse_BSH=None, block: int = 256, reduce: str = "sum",
                    lengths_B=None, segments: int = 8):
    """Per key ``t``, over the queries ``d >= t + w`` (of each row's ``lengths``), the log of the
    summed attention mass (``reduce="sum"``) or of the largest probability (``"max"``):
    ``float32 [B, K, G, S]``, blockwise over queries (``lax.scan``), never forming ``S x S``.
    ``lse``: the supervised pass's per-query log-sum-exp (``None``: dense causal).

    The query blocks are scanned in up to ``segments`` runs; a run whose last query is ``e - 1``
    reads only the keys ``t < e - w`` (the later ones would get ``-inf``): with a block count that
    is a multiple of 8, 8 runs form about 56% of the ``S x S`` logits, while each run keeps one
    block's arrays (a scan)."""
    B, S, H, D = q_BSHD.shape
    K = k_BSKD.shape[2]
    if H % K:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({K})")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")
    if segments < 1:
        raise ValueError(f"segments must be >= 1, got {segments}")
    if lse_BSH is None:
        causal = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]
        _, lse_BSH, _ = grouped_attention(q_BSHD, k_BSKD, k_BSKD, allowed=causal)
    G = H // K
    nblk = -(-S // block)
    pad = nblk * block - S
    qg = jnp.pad(q_BSHD.reshape(B, S, K, G, D).astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    lse_g = jnp.pad(lse_BSH.reshape(B, S, K, G).astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    kf = k_BSKD.astype(jnp.float32)
    n = _valid_length(S, lengths_B)
    merge = jnp.logaddexp if reduce == "sum" else jnp.maximum
    acc = jnp.full((B, K, G, S), -jnp.inf, jnp.float32)
    per_run = max(1, -(-nblk // segments))
    for b0 in range(0, nblk, per_run):
        b1 = min(nblk, b0 + per_run)
        m = min(S, b1 * block) - window                                          # keys this run's queries reach
        if m <= 0:
            continue
        t, km = jnp.arange(m), kf[:, :m]

        def body(acc_BKGM, i):                       # traced here, so it reads this run's t and km
            d = i * block + jnp.arange(block)
            qb = jax.lax.dynamic_slice_in_dim(qg, i * block, block, axis=1)      # [B, C, K, G, D]
            lb = jax.lax.dynamic_slice_in_dim(lse_g, i * block, block, axis=1)   # [B, C, K, G]
            logits = jnp.einsum("bckgd,btkd->bkgct", qb, km) * D ** -0.5
            logits = logits - jnp.transpose(lb, (0, 2, 3, 1))[..., None]
            ok = (d[None, :, None] >= t[None, None, :] + window) & (d[None, :, None] < n[:, :, None])
            logits = jnp.where(ok[:, None, None], logits, -jnp.inf)
            part = jax.nn.logsumexp(logits, axis=3) if reduce == "sum" else jnp.max(logits, axis=3)
            return merge(acc_BKGM, part), None

        run, _ = jax.lax.scan(body, acc[..., :m], jnp.arange(b0, b1))          # continues the earlier runs
        acc = acc.at[..., :m].set(run)
    return acc


def target_from_log_mass(log_mass_BKGS, *, window: int, aggregate: str, eps: float = 1e-8, lengths_B=None):
    """``float32 [B, K, S]``: ``log(eps + m(t))`` with ``m`` the mass per future query
    (divided by ``max(1, n - (t + w))``), aggregated over the group by ``max`` or ``mean``;
    ``-inf`` where no query is ``>= t + w``."""
    S = log_mass_BKGS.shape[-1]
    t = jnp.arange(S)
    n_BS = _valid_length(S, lengths_B)
    log_n = jnp.log(jnp.maximum(1, n_BS - (t + window)).astype(jnp.float32))[:, None, None, :]
    log_m = log_mass_BKGS - log_n
    if aggregate == "max":
        out = jnp.logaddexp(jnp.max(log_m, axis=2), jnp.log(eps))
    elif aggregate == "mean":
        G = log_m.shape[2]
        out = jnp.logaddexp(jax.nn.logsumexp(log_m, axis=2) - jnp.log(G), jnp.log(eps))
    else:
        raise ValueError(f"aggregate must be 'max' or 'mean', got {aggregate!r}")
    return jnp.where((t + window < n_BS)[:, None, :], out, -jnp.inf)


def transposed_target(q_BSHD, k_BSKD, lse_BSH, *, window: int, aggregate: str = "max", eps: float = 1e-8):
    """``float32 [B, K, S]`` log future-attention mass (``-inf`` where no query is ``>= t + w``)."""
    mass = future_log_mass(q_BSHD, k_BSKD, window=window, lse_BSH=lse_BSH)
    return target_from_log_mass(mass, window=window, aggregate=aggregate, eps=eps)
