"""Oracle priorities: the dense teacher's future attention per layer, in hindsight.

``kind="mean"``: KVpop's training target (mean future attention mass, the seed's
Figure 7 oracle). ``kind="peak"``: the largest attention any single future query
pays the token (:func:`kvjax.targets.peak_future_attention`). ``kind="union"``: the
larger of the token's two percentile ranks (among the tokens with a future), so a token
is kept when either ranking wants it.

Measured on testbed teachers (256 tokens, 75% compression, 100 problems): the mean
keeps the recent structure an answer line copies from but loses far facts read once
(far lookups 60% vs dense 93%); the peak keeps the far facts (92%) but not that
structure (answers 30% vs 71%); the union keeps both better (91%, answers 50%).

:func:`prefill_oracle_priorities` gives the same priorities from a shared context prefill
(the long-context table's): only the question and answer run through the model again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.eviction.shared_prefill import ContextPrefill, record_queries
from kvjax.models.attention import dense_attention
from kvjax.sampling import bucket
from kvjax.targets import peak_from_log_max
from pallas_kernels.reference import future_log_mass, grouped_logits, target_from_log_mass

KINDS = ("mean", "peak", "union")


def _percentile(x_BKS):
    """Rank of each finite entry among the finite ones of its row, in [0, 1)."""
    finite = jnp.isfinite(x_BKS)
    ranks = jnp.argsort(jnp.argsort(jnp.where(finite, x_BKS, -jnp.inf), axis=-1), axis=-1)
    missing = jnp.sum(~finite, axis=-1, keepdims=True)
    return (ranks - missing).astype(jnp.float32) / x_BKS.shape[-1]


def _priorities(mass, S: int, window: int, kind: str, lengths_B=None):
    """``float32 [B, K, S]`` priorities of ``kind`` from ``mass(reduce) -> [B, K, G, S]``: per key,
    over the future queries ``d >= t + w`` of each row, the log of the summed attention
    (``reduce="sum"``) or of the largest probability (``"max"``), as
    :func:`pallas_kernels.reference.future_log_mass` returns them."""
    if kind in ("mean", "union"):        # KVpop's target (kvjax.targets.future_attention_target)
        mean = target_from_log_mass(mass("sum"), window=window, aggregate="max", lengths_B=lengths_B)
    if kind in ("peak", "union"):        # kvjax.targets.peak_future_attention
        peak = peak_from_log_max(mass("max"), window=window, lengths_B=lengths_B)
    if kind == "mean":
        tgt = mean
    elif kind == "peak":
        tgt = peak
    else:
        tgt = jnp.where(jnp.isfinite(mean), jnp.maximum(_percentile(peak), _percentile(mean)), -jnp.inf)
    # tokens with no future query rank by recency (they sit in the window anyway)
    t = jnp.arange(S, dtype=jnp.float32)
    return jnp.where(jnp.isfinite(tgt), tgt, -1e6 + t)   # exact integers in float32


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _oracle(graphdef, params, tokens_BS, window: int, kind: str, lengths_B=None):
    model = nnx.merge(graphdef, params)

    def capture(layer, q, k, v, positions, targets):
        out, lse = dense_attention(q, k, v, positions, positions, prefill=True)   # from position 0: query blocks

        def mass(reduce):
            return future_log_mass(q, k, window=window, lse_BSH=lse, reduce=reduce, lengths_B=lengths_B)

        return out, targets + (_priorities(mass, q.shape[1], window, kind, lengths_B),)

    _, targets = model(tokens_BS, None, capture, ())
    return jnp.stack(targets)


def oracle_priorities(model, tokens_BS, window: int, kind: str = "mean", lengths_B=None):
    """``float32 [L, B, K, S]``: the dense teacher's log future attention (``kind`` above).
    ``lengths_B``: rows padded on the right count only their first ``lengths_B[b]`` queries."""
    if kind not in KINDS:
        raise ValueError(f"oracle kind must be one of {KINDS}, got {kind!r}")
    graphdef, params = nnx.split(model)
    lengths = None if lengths_B is None else jnp.asarray(lengths_B, jnp.int32)
    return _oracle(graphdef, params, jnp.asarray(tokens_BS, jnp.int32), int(window), kind, lengths)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _prefill_oracle(graphdef, params, pre: ContextPrefill, tail_BA, window: int, kind: str, tail_B):
    model = nnx.merge(graphdef, params)
    cfg = model.config
    B, A = tail_BA.shape
    S, T = pre.queries.shape[2], pre.dense.k[0].shape[2]
    positions = pre.context[:, None] + jnp.arange(A)[None, :]                  # past T: dropped by the scatter
    state = (pre.dense, jnp.zeros((cfg.num_layers, B, A, cfg.num_heads, cfg.head_dim), pre.queries.dtype),
             jnp.zeros((cfg.num_layers, B, A, cfg.num_heads), jnp.float32))
    _, (dense, q_tail, lse_tail) = model(tail_BA, positions, functools.partial(record_queries, prefill=False), state)
    lengths = pre.context + tail_B                                              # [B]: each row's whole sequence
    t = jnp.arange(T)
    tail_ok = ((positions[:, :, None] >= t[None, None, :] + window)
               & (jnp.arange(A)[None, :, None] < tail_B[:, None, None]))[:, None, None]   # [B, 1, 1, A, T]

    def layer(x):
        q_ctx, lse_ctx, k_BKTD, q_t, lse_t = x

        def mass(reduce):
            k_ctx = jnp.swapaxes(k_BKTD[:, :, :S], 1, 2)                        # the context's keys [B, S, K, D]
            ctx = future_log_mass(q_ctx, k_ctx, window=window, lse_BSH=lse_ctx, reduce=reduce,
                                  lengths_B=pre.context)                        # context queries: [B, K, G, S]
            ctx = jnp.pad(ctx, ((0, 0), (0, 0), (0, 0), (0, T - S)), constant_values=-jnp.inf)
            logits = grouped_logits(q_t, k_BKTD, kv_layout="BKTD")              # tail queries: [B, K, G, A, T]
            G = logits.shape[2]
            logits = logits - jnp.transpose(lse_t.reshape(B, A, -1, G), (0, 2, 3, 1))[..., None]
            logits = jnp.where(tail_ok, logits, -jnp.inf)
            if reduce == "sum":
                return jnp.logaddexp(ctx, jax.nn.logsumexp(logits, axis=3))
            return jnp.maximum(ctx, jnp.max(logits, axis=3))

        return _priorities(mass, T, window, kind, lengths)

    return jax.lax.map(layer, (pre.queries, pre.lse, jnp.stack(dense.k), q_tail, lse_tail))


def prefill_oracle_priorities(model, pre: ContextPrefill, tails, window: int, kind: str = "mean"):
    """:func:`oracle_priorities` of each row's context + tail (``tails``: a list of token lists,
    e.g. the question and the dense answer) from a shared context prefill
    (:func:`kvjax.eviction.shared_prefill.prefill_context` with ``keep_queries=True``):
    ``float32 [L, B, K, T]`` over the prefill's ``T`` cache slots. The context's queries and
    log-sum-exps come from the prefill, so only the tail runs through the model; the context
    queries' future mass is :func:`~pallas_kernels.reference.future_log_mass`, the tail's is
    added in log space. Equal to ``oracle_priorities`` on the concatenated rows (tested)."""
    if kind not in KINDS:
        raise ValueError(f"oracle kind must be one of {KINDS}, got {kind!r}")
    if pre.queries is None or pre.lse is None:
        raise ValueError("prefill_oracle_priorities reads the context's queries: prefill_context(keep_queries=True)")
    n = np.asarray(pre.context)
    a = np.asarray([len(x) for x in tails], np.int32)
    T = pre.dense.k[0].shape[2]
    if len(tails) != len(n):
        raise ValueError(f"tails: {len(tails)} rows, the prefill has {len(n)}")
    if a.min() < 1 or int((n + a).max()) > T:
        raise ValueError(f"tails: every row needs 1 to T - n_b tokens (T = {T} slots); "
                         f"got lengths {a.tolist()} after contexts {n.tolist()}")
    A = bucket(int(a.max()))
    tokens = np.zeros((len(tails), A), np.int32)
    for b, x in enumerate(tails):
        tokens[b, :len(x)] = x
    graphdef, params = nnx.split(model)
    return _prefill_oracle(graphdef, params, pre, jnp.asarray(tokens), int(window), kind, jnp.asarray(a))
