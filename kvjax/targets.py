"""KVpop's future-attention target (seed Eqs. 8, 15, 16; docs/design.md, "Targets and losses").

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
accumulates a per-key log-sum-exp over query blocks (``lax.scan``; the XLA reference of the
``pallas_kernels`` transposed kernel, :func:`pallas_kernels.reference.future_log_mass`).
``dense_target`` is the materialising reference, for tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import NEG_INF, future_log_mass, grouped_logits, target_from_log_mass

NEG = -jnp.inf


def _finish(log_mass_BKGS, S: int, window: int, aggregate: str, eps: float, lengths_B=None):
    """The target from the summed log mass ``[B, K, G, S]`` (normalisation and group aggregate)."""
    assert log_mass_BKGS.shape[-1] == S
    return target_from_log_mass(log_mass_BKGS, window=window, aggregate=aggregate, eps=eps, lengths_B=lengths_B)


def future_attention_target(q, k, *, window: int, lse=None, aggregate: str = "max", eps: float = 1e-8,
                            block: int = 256, lengths_B=None):
    """``q [B, S, Hq, D]``, ``k [B, S, Hkv, D]`` (post-RoPE) -> ``float32 [B, Hkv, S]`` log future mass.

    ``lse [B, S, Hq]``: the supervised pass's per-query log-sum-exp (``None``: dense causal).
    ``lengths_B``: each row's length when rows are padded on the right (``S`` in the
    equation becomes the row's length; padding queries read nothing).
    """
    if aggregate not in ("max", "mean"):
        raise ValueError(f"aggregate must be 'max' or 'mean', got {aggregate!r}")
    acc = future_log_mass(q, k, window=window, lse_BSH=lse, block=block, reduce="sum", lengths_B=lengths_B)
    return _finish(acc, q.shape[1], window, aggregate, eps, lengths_B)


def peak_future_attention(q, k, *, window: int, lse=None, block: int = 256, lengths_B=None):
    """``q [B, S, Hq, D]``, ``k [B, S, Hkv, D]`` -> ``float32 [B, Hkv, S]``: ``r_peak`` above
    (``-inf`` where ``t + w >= S``), blockwise over queries like the mean target."""
    log_max = future_log_mass(q, k, window=window, lse_BSH=lse, block=block, reduce="max", lengths_B=lengths_B)
    return peak_from_log_max(log_max, window=window, lengths_B=lengths_B)


def peak_from_log_max(log_max_BKGS, *, window: int, lengths_B=None):
    """``r_peak [B, K, S]`` from each query head's largest log probability ``[B, K, G, S]``
    (``future_log_mass(reduce="max")``): the max over the group, ``-inf`` where ``t + w >= n``."""
    S = log_max_BKGS.shape[-1]
    n = jnp.full((1, 1), S) if lengths_B is None else jnp.asarray(lengths_B)[:, None]
    return jnp.where((jnp.arange(S) + window < n)[:, None, :], jnp.max(log_max_BKGS, axis=2), NEG)


def dense_target(q, k, *, window: int, lse=None, aggregate: str = "max", eps: float = 1e-8):
    """Reference: materialise ``p(d -> t)`` (``[B, K, G, S, S]``) and sum the columns."""
    B, S, H, D = q.shape
    K = k.shape[2]
    logits = grouped_logits(q.astype(jnp.float32), k.astype(jnp.float32))
    if lse is None:
        causal = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]
        lse_bkgs = jax.nn.logsumexp(jnp.where(causal, logits, NEG_INF), axis=-1)
    else:
        lse_bkgs = jnp.transpose(lse.reshape(B, S, K, H // K), (0, 2, 3, 1))
    p = jnp.exp(logits - lse_bkgs[..., None])
    d, t = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    mass = jnp.sum(jnp.where(d >= t + window, p, 0.0), axis=3)                   # [B, K, G, S]
    return _finish(jnp.log(mass), S, window, aggregate, eps)
