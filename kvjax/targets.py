"""KVpop's future-attention target (seed Eqs. 8, 15, 16; DESIGN.md "Targets").

For query head ``g`` in the group of KV head ``h`` and causal attention probabilities
``p(d -> t)`` of the pass being supervised:

    m_hg(t) = (1 / N_t) * sum_{d >= t + w} p(d -> t),      N_t = max(1, S - (t + w))
    r_tgt(h, t) = max_g log(eps + m_hg(t))                  (aggregate="max")
    r_tgt(h, t) = log(eps + mean_g m_hg(t))                 (aggregate="mean")

Tokens with no future query (``t + w >= S``) carry no target (``-inf``).

``peak_future_attention`` is a hindsight oracle beside it, not a training target: the
largest probability any single future query gives the token,

    r_peak(h, t) = max_g max_{d >= t + w} log p_g(d -> t),

which keeps a token that is read once, strongly, long after it was written (a fact
looked up at the end), where the mean above divides that one read by ``N_t``.

``future_attention_target`` never forms the ``S x S`` matrix: it swaps queries and keys,
subtracts each original query's log-sum-exp from its logits, masks ``d < t + w``, and
accumulates a per-key log-sum-exp over query blocks (``lax.scan``). ``dense_target`` is
the materialising reference, for tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.models.attention import dense_attention

NEG = -jnp.inf


def _group(q_BSHD, K):
    B, S, H, D = q_BSHD.shape
    return q_BSHD.reshape(B, S, K, H // K, D)


def _valid_length(S: int, lengths_B):
    """``[B or 1, 1]`` query count of each row: its length, or ``S`` (rows padded on the right)."""
    return jnp.full((1, 1), S) if lengths_B is None else jnp.asarray(lengths_B)[:, None]


def _finish(log_mass_BKGS, S: int, window: int, aggregate: str, eps: float, lengths_B=None):
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
    return jnp.where((t + window < n_BS)[:, None, :], out, NEG)


def _scan_future(q, k, window: int, lse, block: int, reduce: str, lengths_B=None):
    """Per-key reduction over queries ``d >= t + w`` of ``log p(d -> t)``, blockwise over
    queries: ``reduce="sum"`` gives the log of the summed mass, ``"max"`` the log of the
    largest probability; ``float32 [B, Hkv, G, S]``, never forming ``S x S``."""
    B, S, H, D = q.shape
    K = k.shape[2]
    if H % K:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({K})")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if lse is None:
        pos = jnp.broadcast_to(jnp.arange(S), (B, S))
        _, lse = dense_attention(q, k, k, pos, pos)
    G = H // K
    nblk = -(-S // block)
    pad = nblk * block - S
    qg = jnp.pad(_group(q, K).astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    lse_g = jnp.pad(lse.reshape(B, S, K, G).astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    kf = k.astype(jnp.float32)
    t = jnp.arange(S)

    def body(acc_BKGS, i):
        d = i * block + jnp.arange(block)
        qb = jax.lax.dynamic_slice_in_dim(qg, i * block, block, axis=1)          # [B, C, K, G, D]
        lb = jax.lax.dynamic_slice_in_dim(lse_g, i * block, block, axis=1)       # [B, C, K, G]
        logits = jnp.einsum("bckgd,btkd->bkgct", qb, kf) * D ** -0.5
        logits = logits - jnp.transpose(lb, (0, 2, 3, 1))[..., None]
        ok = (d[None, :, None] >= t[None, None, :] + window) & (d[None, :, None] < _valid_length(S, lengths_B)[:, :, None])
        logits = jnp.where(ok[:, None, None], logits, NEG)
        if reduce == "sum":
            return jnp.logaddexp(acc_BKGS, jax.nn.logsumexp(logits, axis=3)), None
        return jnp.maximum(acc_BKGS, jnp.max(logits, axis=3)), None

    acc, _ = jax.lax.scan(body, jnp.full((B, K, G, S), NEG, jnp.float32), jnp.arange(nblk))
    return acc


def future_attention_target(q, k, *, window: int, lse=None, aggregate: str = "max", eps: float = 1e-8,
                            block: int = 256, lengths_B=None):
    """``q [B, S, Hq, D]``, ``k [B, S, Hkv, D]`` (post-RoPE) -> ``float32 [B, Hkv, S]`` log future mass.

    ``lse [B, S, Hq]``: the supervised pass's per-query log-sum-exp (``None``: dense causal).
    ``lengths_B``: each row's length when rows are padded on the right (``S`` in the
    equation becomes the row's length; padding queries read nothing).
    """
    if aggregate not in ("max", "mean"):
        raise ValueError(f"aggregate must be 'max' or 'mean', got {aggregate!r}")
    acc = _scan_future(q, k, window, lse, block, "sum", lengths_B)
    return _finish(acc, q.shape[1], window, aggregate, eps, lengths_B)


def peak_future_attention(q, k, *, window: int, lse=None, block: int = 256, lengths_B=None):
    """``q [B, S, Hq, D]``, ``k [B, S, Hkv, D]`` -> ``float32 [B, Hkv, S]``: ``r_peak`` above
    (``-inf`` where ``t + w >= S``), blockwise over queries like the mean target."""
    S = q.shape[1]
    acc = jnp.max(_scan_future(q, k, window, lse, block, "max", lengths_B), axis=2)
    return jnp.where((jnp.arange(S) + window < _valid_length(S, lengths_B))[:, None, :], acc, NEG)


def dense_target(q, k, *, window: int, lse=None, aggregate: str = "max", eps: float = 1e-8):
    """Reference: materialise ``p(d -> t)`` (``[B, K, G, S, S]``) and sum the columns."""
    B, S, H, D = q.shape
    K = k.shape[2]
    qg = _group(q, K).astype(jnp.float32)
    logits = jnp.einsum("bskgd,btkd->bkgst", qg, k.astype(jnp.float32)) * D ** -0.5
    if lse is None:
        causal = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]
        lse_bkgs = jax.nn.logsumexp(jnp.where(causal, logits, NEG), axis=-1)
    else:
        lse_bkgs = jnp.transpose(lse.reshape(B, S, K, H // K), (0, 2, 3, 1))
    p = jnp.exp(logits - lse_bkgs[..., None])
    d, t = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    mass = jnp.sum(jnp.where(d >= t + window, p, 0.0), axis=3)                   # [B, K, G, S]
    with jax.numpy_dtype_promotion("standard"):
        log_mass = jnp.log(mass)
    return _finish(log_mass, S, window, aggregate, eps)
