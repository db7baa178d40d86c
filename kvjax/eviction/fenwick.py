"""Running top-k cutoffs of the keep rule (Algorithm 2 of the KVpop seed).

Per row (batch row, layer, KV head) with static priorities ``p_t`` and budget
``(s, w, k)``, the eligible set at query ``q`` is ``E(q) = {t : s <= t <= q - w}``.
Tokens are ranked once: ``rank(t) = #{u : (p_u, u) > (p_t, t)}`` (priority
descending, ties to the larger ``t``), so rank 0 is the best token. The cutoff is

    tau_q = -1                                   if k == 0
          = S                                    if 0 < k and |E(q)| < k  (all eligible kept)
          = k-th smallest rank(t) over E(q)      otherwise,

and the kept long-range tokens at ``q`` are ``{t in E(q) : rank(t) <= tau_q}``.
``E(q)`` only grows with ``q``, so ``tau_q`` is non-increasing in ``q``.

A Fenwick tree over ranks counts the inserted (eligible) tokens; the k-th
smallest inserted rank is found by binary lifting in ``O(log S)``. To keep
XLA's per-op overhead off the critical path, queries are processed in chunks
of ``C``: at a chunk start the tree holds ``A`` (tokens eligible before the
chunk), and the query ``j`` of the chunk sees ``A`` plus ``B_j``, the first
``j + 1`` tokens the chunk inserts (``|B_j| <= C``). Since fewer than ``C``
tokens of ``B_j`` can precede it, the k-th smallest of ``A u B_j`` is at least
``a_(k-C)`` (``a_(m)``: m-th smallest of ``A``), so it is found among
``D = {a_(k-C), ..., a_(k)}`` (``C + 1`` parallel liftings) and ``B_j`` by
counting: for a candidate ``v >= a_(k-C)``,
``#{A u B_j <= v} = (k - C - 1) + #{D <= v} + #{B_j <= v}``. The chunk's
tokens are then inserted with one scatter. Work is ``O(S (log S + C))``; with
``chunk=1`` this is Algorithm 2 step by step.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

DEFAULT_CHUNK = 32


def validate_budget(sinks: int, window: int, topk: int) -> tuple[int, int, int]:
    """Check the keep-rule budget ``(s, w, k)``; raise ``ValueError`` naming the field."""
    values = []
    for name, value, least in (("sinks", sinks, 0), ("window", window, 1), ("topk", topk, 0)):
        if isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise ValueError(f"{name} must be an int, got {value!r}") from None
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
        values.append(value)
    return tuple(values)


def validate_priority(priority, *, min_ndim: int = 1) -> jax.Array:
    """Return ``priority`` as a real array of rank >= ``min_ndim`` with ``S >= 1``."""
    priority = jnp.asarray(priority)
    if priority.ndim < min_ndim:
        raise ValueError(f"priority must have >= {min_ndim} dims [..., S], got shape {priority.shape}")
    if priority.shape[-1] == 0:
        raise ValueError(f"priority must have S >= 1 tokens, got shape {priority.shape}")
    if not (jnp.issubdtype(priority.dtype, jnp.floating) or jnp.issubdtype(priority.dtype, jnp.integer)):
        raise ValueError(f"priority must be real-valued, got dtype {priority.dtype}")
    return priority


def token_ranks(priority_XS: jax.Array) -> jax.Array:
    """Static rank of each token: 0 = highest priority, ties to the larger ``t``.

    ``priority_XS [..., S]`` -> ``int32 [..., S]``, a permutation of ``0..S-1``
    per row. NaN priorities rank last.
    """
    priority_XS = validate_priority(priority_XS)
    return _token_ranks(priority_XS)


@jax.jit
def _token_ranks(priority_XS: jax.Array) -> jax.Array:
    S = priority_XS.shape[-1]
    # Stable sort of -p over tokens in reversed order puts larger t first among ties.
    order_rev_XS = jnp.argsort(-priority_XS[..., ::-1], axis=-1, stable=True)
    order_XS = (S - 1 - order_rev_XS).astype(jnp.int32)
    rank_XS = jnp.zeros(priority_XS.shape, jnp.int32)
    positions_XS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), priority_XS.shape)
    return jnp.put_along_axis(rank_XS, order_XS, positions_XS, axis=-1, inplace=False)


def fenwick_cutoffs(priority_XS, *, sinks: int, window: int, topk: int, chunk: int = DEFAULT_CHUNK) -> jax.Array:
    """Per-query cutoffs ``tau_q`` (module docstring) for ``priority [..., S]``.

    Returns ``int32 [..., S]``: ``-1`` when ``topk == 0``, ``S`` while fewer than
    ``topk`` tokens are eligible, else the rank of the ``topk``-th best eligible
    token. ``chunk`` is the number of queries resolved per tree pass (>= 1).
    """
    sinks, window, topk = validate_budget(sinks, window, topk)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    priority_XS = validate_priority(priority_XS)
    S = priority_XS.shape[-1]
    # Values above S + 1 behave like S + 1; clamping keeps them in int32.
    sinks, window, topk = (min(v, S + 1) for v in (sinks, window, topk))
    return _fenwick_cutoffs(priority_XS, sinks=sinks, window=window, topk=topk, chunk=chunk)


@jax.jit(static_argnames=("chunk",))
def _fenwick_cutoffs(priority_XS, *, sinks, window, topk, chunk):
    """Jitted core; the budget is traced, so only ``S`` and ``chunk`` recompile."""
    lead, S = priority_XS.shape[:-1], priority_XS.shape[-1]
    rank_HS = _token_ranks(priority_XS).reshape(-1, S)
    cutoff_HS = _chunked_cutoffs(rank_HS, sinks, window, topk, chunk=min(chunk, S))
    return jnp.where(topk == 0, -1, cutoff_HS).reshape(*lead, S)


def _chunked_cutoffs(rank_HS, sinks, window, topk, *, chunk):
    """Cutoffs for ranks ``[H, S]``, ``C = chunk`` queries per scan step."""
    H, S = rank_HS.shape
    C = chunk
    num_chunks = -(-S // C)
    N = 1 << (S - 1).bit_length()  # tree slots 1..N hold ranks 0..S-1; slot 0 absorbs no-ops
    depth = N.bit_length() - 1
    head_H1 = jnp.arange(H, dtype=jnp.int32)[:, None]
    j_C = jnp.arange(C, dtype=jnp.int32)
    m_M = topk - C + jnp.arange(C + 1, dtype=jnp.int32)  # lifting targets k-C .. k give D
    base = jnp.maximum(topk - C - 1, 0)  # |{a in A : a < a_(k-C)}| when a_(k-C) exists
    tag_M = jnp.full(C + 1, -1, jnp.int32)  # D is visible to every query of the chunk

    def step(carry, c):
        # Insert the previous chunk's tokens first: the tree is then only read
        # after it is written, which lets XLA update it in place.
        tree_HN, pending_HC = carry
        path_HCL = _fenwick_path(pending_HC, depth, N)
        tree_HN = tree_HN.at[head_H1[:, :, None], path_HCL].add(1, mode="promise_in_bounds")
        q0 = c * C
        t_C = q0 + j_C - window
        new_C = (t_C >= sinks) & (t_C < S)
        b_HC = jnp.where(new_C, jnp.take(rank_HS, jnp.clip(t_C, 0, S - 1), axis=1), S)
        num_a = jnp.maximum(q0 - window - sinks, 0)
        # Missing candidates carry value S: they sort last and can only yield S.
        d_HM = jnp.where((m_M >= 1) & (m_M <= num_a), _kth_smallest(tree_HN, m_M, depth), S)
        value_HP = jnp.concatenate([d_HM, b_HC], axis=1)
        tag_HP = jnp.concatenate([jnp.broadcast_to(tag_M, (H, C + 1)), jnp.broadcast_to(j_C, (H, C))], axis=1)
        value_HP, tag_HP = lax.sort((value_HP, tag_HP), dimension=1, num_keys=1)
        seen_HCP = tag_HP[:, None, :] <= j_C[None, :, None]  # candidate present at query j
        count_HCP = base + jnp.cumsum(seen_HCP, axis=-1, dtype=jnp.int32)
        cutoff_HC = jnp.min(jnp.where(count_HCP >= topk, value_HP[:, None, :], S), axis=-1)
        return (tree_HN, jnp.where(new_C, b_HC + 1, 0)), cutoff_HC

    init = (jnp.zeros((H, N + 1), jnp.int32), jnp.zeros((H, C), jnp.int32))
    _, cutoff_KHC = lax.scan(step, init, jnp.arange(num_chunks, dtype=jnp.int32))
    return cutoff_KHC.transpose(1, 0, 2).reshape(H, num_chunks * C)[:, :S]


def _fenwick_path(slot_X, depth, size):
    """Fenwick update indices of ``slot`` (``i, i + lowbit(i), ...`` up to ``size``).

    Closed form: ``i`` and, for every bit ``b >= 1`` that is 0 in ``i`` with a set
    bit below it, ``((i >> b) | 1) << b``; unused entries point at slot 0.
    ``slot_X [...]`` -> ``[..., depth + 1]``.
    """
    bit_B = jnp.arange(1, depth + 1, dtype=jnp.int32)
    i_XB = slot_X[..., None]
    next_XB = ((i_XB >> bit_B) | 1) << bit_B
    on_path_XB = (((i_XB >> bit_B) & 1) == 0) & ((i_XB & ((1 << bit_B) - 1)) != 0) & (next_XB <= size)
    return jnp.concatenate([slot_X[..., None], jnp.where(on_path_XB, next_XB, 0)], axis=-1)


def _kth_smallest(tree_HN, m_M, depth):
    """Binary lifting: largest ``pos`` with ``prefix_count(pos) < m``, i.e. the
    0-based rank of the m-th smallest inserted rank (when it exists). ``-> [H, M]``."""
    H = tree_HN.shape[0]
    pos_HM = jnp.zeros((H, m_M.shape[0]), jnp.int32)
    rem_HM = jnp.broadcast_to(m_M, pos_HM.shape)
    for level in reversed(range(depth)):
        step = 1 << level
        count_HM = jnp.take_along_axis(tree_HN, pos_HM + step, axis=1, mode="promise_in_bounds")
        go_HM = count_HM < rem_HM
        pos_HM = jnp.where(go_HM, pos_HM + step, pos_HM)
        rem_HM = jnp.where(go_HM, rem_HM - count_HM, rem_HM)
    return pos_HM


def naive_cutoffs(priority_S, *, sinks: int, window: int, topk: int) -> np.ndarray:
    """``O(S^2 log S)`` NumPy reference for one row: sort ``E(q)`` at every ``q``."""
    sinks, window, topk = validate_budget(sinks, window, topk)
    priority_S = np.asarray(priority_S)
    S = priority_S.shape[0]
    order = sorted(range(S), key=lambda t: (-priority_S[t], -t))
    rank_S = np.empty(S, np.int64)
    rank_S[order] = np.arange(S)
    cutoff_S = np.full(S, -1 if topk == 0 else S, np.int32)
    for q in range(S):
        eligible_ranks = np.sort(rank_S[sinks : max(q - window + 1, sinks)])
        if topk > 0 and len(eligible_ranks) >= topk:
            cutoff_S[q] = eligible_ranks[topk - 1]
    return cutoff_S
