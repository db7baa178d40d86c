"""Many prefill-compression policies on one dense prefill (kvpress's setting, evaluated fast).

In :mod:`kvjax.eviction.prompt_compressed`'s setting the context's keys and values do not
depend on the policy: a context query sees every context token before it. So

1. :func:`prefill_context` runs the dense pass over the contexts once (``[B, S]``, right
   padded, row ``b``'s context ``n_b`` tokens), keeping each layer's queries when an
   attention-statistic ranker will need them;
2. :func:`compress` ranks that cache for one :class:`PromptCompressed` policy: per layer the
   same kept set as the one-pass prefill (:meth:`PromptCompressed.layer_keep`); an attention
   statistic is computed once per batch and shared by every ratio and every policy with the
   same statistic (``memo``);
3. :func:`answer` drops the evicted entries (:func:`kvjax.cache.compressed.compact`: a decode
   step reads the ``M`` kept slots, not all ``T``), feeds each row's question as one chunk at
   positions ``n_b ..`` and decodes greedily (:func:`kvjax.generate.decode_loop`).

Per policy only steps 2 and 3 run: a question of ``Q`` tokens instead of the whole prompt.
The tokens equal ``kvjax.generate(model, context + question, policy=prompt_compressed(...))``
(tested), since the question sees exactly the kept context in both. The compaction halves
a policy's answering time at 4k tokens (B=4, 75%: 3.45 s against 6.45 s with every slot read;
88%: 2.63 s against 6.95 s); stacking many policies' caches into one batch gained nothing
on 2 CPU cores (the decode is compute-bound there), so each policy answers alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kvjax import decode
from kvjax.cache import CompactCache, CompressedCache, DenseCache, dense_cache_attention
from kvjax.cache.compressed import attend_compact, compact, kept_context
from kvjax.eviction.prompt_compressed import PromptCompressed
from kvjax.generate import decode_loop
from kvjax.sampling import bucket


@struct.dataclass
class ContextPrefill:
    dense: DenseCache              # the contexts' keys and values, slots [0, S) of T
    queries: jax.Array | None      # [L, B, S, H, D] (attention-statistic rankers and oracles), or None
    context: jax.Array             # int32 [B]: n_b
    lse: jax.Array | None = None   # float32 [L, B, S, H]: each query's log-sum-exp (kept with the queries)
    tokens: jax.Array | None = None   # int32 [B, S]: the contexts, right padded (a ranker's own pass reads them)


def record_queries(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, state, *, prefill: bool = True):
    """Attention backend over ``state = (DenseCache, queries [L, B, S, H, D] or None, lse [L, B, S, H])``:
    the dense cache's attention (``prefill``: a prompt from position 0, in query blocks), recording
    each layer's queries and log-sum-exps when ``queries`` is given."""
    dense, queries, lse = state
    out, lse_BSH, dense = dense_cache_attention(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, dense, prefill=prefill,
                                                with_lse=True)
    if queries is not None:
        queries = queries.at[layer].set(q_BSHD.astype(queries.dtype))
        lse = lse.at[layer].set(lse_BSH)
    return out, (dense, queries, lse)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("cache_len", "keep_queries"))
def _prefill(graphdef, params, tokens_BS, *, cache_len: int, keep_queries: bool):
    model = nnx.merge(graphdef, params)
    cfg = model.config
    B, S = tokens_BS.shape
    queries = jnp.zeros((cfg.num_layers, B, S, cfg.num_heads, cfg.head_dim), model.dtype) if keep_queries else None
    lse = jnp.zeros((cfg.num_layers, B, S, cfg.num_heads), jnp.float32) if keep_queries else None
    _, (dense, queries, lse) = model(tokens_BS, None, record_queries,
                                     (DenseCache.init(cfg, B, cache_len, model.dtype), queries, lse))
    return dense, queries, lse


def at_least(floor: dict | None, key, n: int) -> int:
    """``n``, raised to the largest size ``floor[key]`` recorded before (which becomes the
    answer). ``floor``: a dict kept across the batches of one evaluation, so that padded sizes
    only grow and a later batch with shorter contexts, questions or kept sets reuses the
    programs an earlier batch compiled; ``None``: ``n``."""
    if floor is None:
        return int(n)
    floor[key] = max(int(n), floor.get(key, 0))
    return floor[key]


def prefill_context(model, contexts, *, cache_len: int, keep_queries: bool, pad_id: int = 0,
                    floor: dict | None = None) -> ContextPrefill:
    """The dense pass over ``contexts`` (a list of token lists), padded to a length bucket;
    ``cache_len`` slots (the longest context + question + answer, at least). ``floor``: see
    :func:`at_least` (the padded context length and ``cache_len`` never shrink)."""
    n = np.asarray([len(c) for c in contexts], np.int32)
    if n.min() < 1:
        raise ValueError("contexts: every row needs at least one token")
    S = at_least(floor, "context", bucket(int(n.max())))
    cache_len = at_least(floor, "cache", cache_len)
    if cache_len < S:
        raise ValueError(f"cache_len {cache_len} is shorter than the padded contexts ({S} tokens)")
    tokens = np.full((len(contexts), S), pad_id, np.int32)
    for b, c in enumerate(contexts):
        tokens[b, :len(c)] = c
    graphdef, params = nnx.split(model)
    dense, queries, lse = _prefill(graphdef, params, jnp.asarray(tokens), cache_len=cache_len,
                                   keep_queries=keep_queries)
    return ContextPrefill(dense, queries, jnp.asarray(n), lse, jnp.asarray(tokens))


@functools.partial(jax.jit, static_argnums=0)
def _statistic_priorities(policy: PromptCompressed, params, pre: ContextPrefill) -> jax.Array:
    """``float32 [L, B, K, S]``: an attention-statistic ranker's priorities, one layer at a time
    (:func:`kvjax.eviction.attention.statistic_scores`: the rows it reads, in blocks)."""
    S = pre.queries.shape[2]
    k_LBSKD = jnp.stack([jnp.swapaxes(k[:, :, :S], 1, 2) for k in pre.dense.k])
    return jax.lax.map(lambda x: policy.priority(params, 0, x[0], x[1], None, None, None), (pre.queries, k_LBSKD))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _compress(policy: PromptCompressed, params, cfg, pre: ContextPrefill, prio_LBKS) -> CompressedCache:
    B, K, T, _ = pre.dense.k[0].shape
    if policy.needs_table:          # a shared budget: every layer's priorities first, then one top-k
        table = prio_LBKS if prio_LBKS is not None else policy.context_table(params, cfg, pre.dense.k, pre.dense.v)
        cache = decode.open_cache(policy, {**params, "table": table}, cfg, B, T, pre.dense.k[0].dtype, pre.context)
        return cache.replace(dense=pre.dense)
    cache = decode.open_cache(policy, params, cfg, B, T, pre.dense.k[0].dtype, pre.context)
    if policy.ranker.static:        # priorities from keys and values, each layer's scorer its own
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        keeps = tuple(policy.layer_keep(params, layer, None, jnp.swapaxes(pre.dense.k[layer], 1, 2),
                                        jnp.swapaxes(pre.dense.v[layer], 1, 2), positions, cache)
                      for layer in range(cfg.num_layers))
    else:                           # attention statistics: the priorities given, kept per layer
        keeps = tuple(jax.lax.map(lambda x: policy.keep_from_priority(params, x[0], x[1], T),
                                  (prio_LBKS, cache.budgets)))
    return cache.replace(dense=pre.dense, keep=keeps)


def compress(policy: PromptCompressed, model, pre: ContextPrefill, memo: dict | None = None) -> CompressedCache:
    """``policy``'s compressed cache from the shared prefill (its context lengths must be
    ``pre.context``). ``memo``: a dict kept for this prefill only; attention-statistic
    priorities are computed once per :attr:`PromptCompressed.statistic_key` and reused (H2O's
    ``S x S`` statistic once for every ratio; SnapKV's for PyramidKV and Ada-KV too)."""
    if not np.array_equal(np.asarray(policy.params["context"]), np.asarray(pre.context)):
        raise ValueError("compress: the policy was built for other context lengths than the prefill's")
    if hasattr(policy.ranker, "scored") and policy.params["ranker"] is None:   # KVzip: its pass on this prefill
        key = ("scored", type(policy.ranker), policy.ranker.prompts)
        if memo is None or key not in memo:
            n, toks = np.asarray(pre.context), np.asarray(pre.tokens)
            ranker = policy.ranker.scored(model, pre.dense.k, pre.dense.v, [toks[b, :n[b]].tolist() for b in range(len(n))])
            if memo is not None:
                memo[key] = ranker
        policy = policy.with_ranker(dataclasses.replace(memo[key] if memo is not None else ranker,
                                                        config=policy.ranker.config))
    prio = None
    if not policy.ranker.static:
        if pre.queries is None:
            raise ValueError(f"compress: {policy.ranker.name!r} ranks by attention; "
                             "prefill_context(keep_queries=True)")
        key = policy.statistic_key
        if memo is not None and key in memo:
            prio = memo[key]
        else:
            prio = _statistic_priorities(policy, policy.params, pre)
            if memo is not None:
                memo[key] = prio
    return _compress(policy, policy.params, model.config, pre, prio)


def uncompressed(pre: ContextPrefill) -> CompressedCache:
    """The shared prefill with every slot visible: :func:`answer` then gives the dense model's tokens."""
    B, K, T, _ = pre.dense.k[0].shape
    keep = tuple(jnp.ones((B, K, T), bool) for _ in pre.dense.k)
    return CompressedCache(pre.dense, keep, jnp.zeros((len(keep), B, K), jnp.int32))


@functools.partial(jax.jit, static_argnums=0, static_argnames=("new_cap", "eos_ids", "pad_id"))
def _answer(graphdef, params, cache: CompactCache, question_BQ, question_B, context_B, max_new, *, new_cap: int,
            eos_ids: tuple[int, ...], pad_id: int):
    model = nnx.merge(graphdef, params)
    state = decode.start(cache, context_B)
    hidden, state = decode.feed_prompt(model, attend_compact, state, question_BQ, question_B)
    pick = lambda logits, _key: jnp.argmax(logits, axis=-1).astype(jnp.int32)      # noqa: E731  greedy
    state = state.replace(token=pick(decode.last_logits(model, hidden, question_B), None))
    return decode_loop(model, attend_compact, state, max_new, pick, new_cap=new_cap, eos_ids=eos_ids, pad_id=pad_id)


def answer(model, cache: CompressedCache | CompactCache, questions, context_B, max_new: int, *, eos_ids,
           pad_id: int = 0, floor: dict | None = None) -> np.ndarray:
    """Greedy new tokens ``int32 [B, max_new]`` (``pad_id`` after a row's EOS): each row's
    question (a list of token lists, each non-empty) at positions ``n_b ..``, then decoding,
    all under the kept set. A :class:`CompressedCache` is compacted first. ``floor``: see
    :func:`at_least` (the padded question and the compacted slots never shrink; keep one per
    policy and ratio, since their kept sets differ in size)."""
    q = np.asarray([len(x) for x in questions], np.int32)
    if q.min() < 1:
        raise ValueError("questions: every row needs at least one token")
    Q, N = at_least(floor, "question", bucket(int(q.max()))), bucket(int(max_new))
    if isinstance(cache, CompressedCache):
        T = cache.keep[0].shape[-1]
        need = int(np.max(np.asarray(context_B) + q)) + N
        if need > T:
            raise ValueError(f"the cache holds {T} slots; contexts + questions + max_new need {need}")
        slots = min(at_least(floor, "slots", bucket(kept_context(cache, context_B))), T)
        cache = compact(cache, context_B, extra=Q + N, slots=slots)
    elif cache.extra < Q + N:
        raise ValueError(f"the compact cache has {cache.extra} slots past the context; the padded questions "
                         f"and max_new need {Q + N}")
    if cache.shift.shape[0] != len(questions):
        raise ValueError(f"the cache has {cache.shift.shape[0]} rows, the questions {len(questions)}")
    tokens = np.full((len(questions), Q), pad_id, np.int32)
    for b, x in enumerate(questions):
        tokens[b, :len(x)] = x
    graphdef, params = nnx.split(model)
    out = _answer(graphdef, params, cache, jnp.asarray(tokens), jnp.asarray(q), jnp.asarray(context_B, jnp.int32),
                  jnp.int32(max_new), new_cap=N, eos_ids=tuple(int(e) for e in eos_ids), pad_id=int(pad_id))
    return np.asarray(out)[:, :max_new]
