"""Chunked prefill under the keep rule: bounded attention memory whatever the prompt length.

The one-pass prefill attends with the ``S x S`` keep mask (in a Pallas kernel on GPU/TPU
without materialising it; the XLA path forms it). Here the prompt is cut into chunks of
``C`` queries. Chunk ``i`` attends over the slot buffer left by the chunks before it
(``N = s + w + k_max`` slots) plus its own ``C`` keys, with the keep rule evaluated on those
``N + C`` candidates only, and leaves the buffer as it stands after its last query. That
is exact: the kept set at a query ``q`` inside the chunk is a subset of those candidates,
because the long-range set is the top-``b`` of a set that only grows (``E(q) = {t : s <=
t <= q - w}``), so a token out of the top ``b`` before the chunk never returns; the window
and sinks are in the buffer or in the chunk. Priorities are computed once for the whole
prompt (as in one pass), so every static-priority policy, the mLSTM scorer included, keeps
the same tokens either way. Memory per layer: ``O(C (N + C))`` for the mask and logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache.slots import SlotBuffer
from kvjax.eviction.config import EvictionConfig
from pallas_kernels.reference import grouped_attention


def rank_candidates(pos_BKU, prio_BKU):
    """``(order, inverse)`` ``int [B, K, U]``: candidates best first (priority desc, ties to the
    later position, absent ``pos = -1`` last) and each candidate's place in that order."""
    order = jnp.lexsort((-pos_BKU, jnp.where(pos_BKU >= 0, -prio_BKU, jnp.inf)), axis=-1)
    return order, jnp.argsort(order, axis=-1)


def keep_among(pos_BKU, ranked, budget_BK, q_BQ, ev: EvictionConfig):
    """``bool [B, K, Q, U]``: which of ``U`` candidate tokens (positions ``pos``, ``-1`` = none;
    ``ranked`` from :func:`rank_candidates`) query ``q`` keeps, when the candidates include
    every token the keep rule can keep at ``q`` (the module docstring)."""
    order, inverse = ranked
    present = pos_BKU >= 0
    q = q_BQ[:, None, :, None]
    pos = pos_BKU[:, :, None, :]
    eligible = present[:, :, None] & (pos >= ev.sinks) & (pos <= q - ev.window)        # [B, K, Q, U]
    elig_sorted = jnp.take_along_axis(eligible, order[:, :, None, :], axis=-1)
    better = jnp.cumsum(elig_sorted, axis=-1) - elig_sorted                              # eligible and ranked above
    kept_sorted = elig_sorted & (better < budget_BK[:, :, None, None])
    long_range = jnp.take_along_axis(kept_sorted, inverse[:, :, None, :], axis=-1)
    return present[:, :, None] & (pos <= q) & ((pos < ev.sinks) | (pos > q - ev.window) | long_range)


def chunked_prefill(q_BSHD, k_BSKD, v_BSKD, prio_BKS, lengths_B, buf: SlotBuffer, ev: EvictionConfig, chunk: int):
    """``(out [B, S, H, D], buffer after each row's last prompt token)`` for a prompt at
    positions ``0..S-1`` (row ``b`` real up to ``lengths[b]``), ``chunk`` queries at a time."""
    B, S, H, D = q_BSHD.shape
    K = k_BSKD.shape[2]
    n = -(-S // chunk)
    pad = n * chunk - S

    def chunks(x, axis_s):        # [..] with S at axis_s -> [n, ...] with that axis = chunk
        x = jnp.pad(x, [(0, pad) if a == axis_s else (0, 0) for a in range(x.ndim)])
        x = x.reshape(*x.shape[:axis_s], n, chunk, *x.shape[axis_s + 1:])
        return jnp.moveaxis(x, axis_s, 0)

    qs = chunks(q_BSHD, 1)                                                    # [n, B, C, H, D]
    ks = chunks(jnp.swapaxes(k_BSKD, 1, 2).astype(buf.k.dtype), 2)           # [n, B, K, C, D]
    vs = chunks(jnp.swapaxes(v_BSKD, 1, 2).astype(buf.v.dtype), 2)
    ps = chunks(prio_BKS.astype(jnp.float32), 2)                              # [n, B, K, C]
    N = buf.pos.shape[-1]

    def step(buf: SlotBuffer, xs):
        i, q_c, k_c, v_c, p_c = xs
        pos_c = i * chunk + jnp.arange(chunk)                                 # [C]
        real = pos_c[None, :] < lengths_B[:, None]                            # [B, C]
        pos_u = jnp.concatenate([buf.pos, jnp.broadcast_to(jnp.where(real, pos_c, -1)[:, None], (B, K, chunk))], -1)
        prio_u = jnp.concatenate([buf.prio, p_c], -1)
        k_u = jnp.concatenate([buf.k, k_c], axis=2)                           # [B, K, N + C, D]
        v_u = jnp.concatenate([buf.v, v_c], axis=2)
        ranked = rank_candidates(pos_u, prio_u)                               # one sort for both rows of queries
        keep = keep_among(pos_u, ranked, buf.budget, jnp.broadcast_to(pos_c, (B, chunk)), ev)
        out, _, _ = grouped_attention(q_c, k_u.astype(q_c.dtype), v_u.astype(q_c.dtype), allowed=keep[:, :, None],
                                      kv_layout="BKTD")
        last = jnp.minimum(lengths_B - 1, i * chunk + chunk - 1)              # each row's last query so far
        kept = keep_among(pos_u, ranked, buf.budget, last[:, None], ev)[:, :, 0]   # [B, K, N + C]
        idx = jnp.argsort(~kept, axis=-1, stable=True)[..., :N]              # kept first (at most N of them)
        take = lambda x: jnp.take_along_axis(x, idx, axis=-1)  # noqa: E731
        take_kv = lambda x: jnp.take_along_axis(x, idx[..., None], axis=2)  # noqa: E731
        held = take(kept)
        return buf.replace(k=take_kv(k_u), v=take_kv(v_u), pos=jnp.where(held, take(pos_u), -1),
                           prio=jnp.where(held, take(prio_u), 0.0)), out

    buf, outs = jax.lax.scan(step, buf, (jnp.arange(n), qs, ks, vs, ps))
    out = jnp.moveaxis(outs, 0, 1).reshape(B, n * chunk, H, D)[:, :S]
    return out, buf
