"""KVzip (Kim et al. 2025, arXiv:2505.23416): score each context token by the most attention it
receives while the model reconstructs (repeats) its context; keep one top-k across all layers
and heads.

After a dense prefill of the context ``x_0 .. x_{n-1}`` (a chat-template head of ``p`` tokens,
then the context text), the context text is cut into chunks of ``chunk`` tokens (kvpress: 2048).
For chunk ``c = x_lo .. x_{hi-1}`` the model reads a repeat request after the context,

    r = "\\n\\nRepeat the previous context exactly."  (later chunks: "...the part of the previous
        context exactly, starting with" + the previous chunk's last 8 tokens) + the chat template's
        assistant header + c,

at positions ``n, n + 1, ..`` (its normal attention over the whole context and ``r`` itself), and
each layer's score of context token ``t`` in ``[lo, hi)`` is, per KV head ``h``,

    s_t = max over the group's query heads g and the repeat queries i of
          softmax_i(q_{g,i} . k_j / sqrt(D), j in {first min(4, lo)} + [lo, hi) + r_{<=i})[t]

(kvpress 0.5.5's ``KVzipPress``: the softmax runs over the sinks, the chunk and the repeat only).
The template head past its first 4 tokens scores 0 and the first 4 tokens score highest. The
context is then compressed once (:mod:`kvjax.eviction.prompt_compressed`); the budget is one
top-k across all layers and heads (``budgets="global"``, the default here) or one per layer
across its heads (``budgets="layer"``, kvpress's ``layerwise``). The reconstruction reads about
as many tokens again as the context: about twice a dense prefill's work, measured in
``docs/real-model.md``. Generated tokens are never scored: KVzip compresses a context, its setting
is prefill compression (``kvjax.prompt_compressed``); bounded throughout, the prompt is scored
before it is fed (:meth:`KVzip.prepare`). ``kvzip_plus``
(:class:`KVzipPlus`) adds KVzip+'s normalisation (:func:`reconstruction_scores`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kvjax.eviction.bounded import StaticPriority
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.registry import register

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclasses.dataclass(frozen=True)
class RepeatPrompts:
    """Token ids of the reconstruction requests (kvpress's, from the model's tokenizer)."""

    head: int                    # tokens of the chat template before the user's text (not reconstructed)
    first: tuple[int, ...]       # the first chunk's request
    later: tuple[int, ...]       # a later chunk's request (then the previous chunk's last ``postfix`` tokens)
    suffix: tuple[int, ...]      # the chat template's assistant header, after the request
    sinks: int = 4               # the first tokens, always kept (kvpress's n_sink)
    chunk: int = 2048            # context tokens reconstructed per pass
    postfix: int = 8

    @classmethod
    def from_tokenizer(cls, tokenizer, **kw) -> "RepeatPrompts":
        """As kvpress builds them: the template around a dummy user message splits into head and
        assistant header; without a chat template the head is empty and the header a newline."""
        enc = lambda s: tuple(tokenizer.encode(s, add_special_tokens=False))     # noqa: E731
        if getattr(tokenizer, "chat_template", None) is None:
            head, suffix = "", "\n"
        else:
            dummy = "dummy context"
            sep = "\n" + "#" * len(dummy)
            text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + sep}],
                                                 add_generation_prompt=True, tokenize=False)
            before, suffix = text.split(sep)
            head = before.split(dummy)[0]
        return cls(len(enc(head)) if head else 0, enc(FIRST), enc(LATER), enc(suffix), **kw)


def repeat_prompts_for(model) -> RepeatPrompts:
    """The model's own (its source folder's tokenizer), or a clear error."""
    from kvjax.convert.hf_io import source_folder

    folder = source_folder(model)
    if folder is None or not ((folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()):
        raise ValueError("kvzip builds its reconstruction request with the model's tokenizer: load the model "
                         "from a folder with a tokenizer (kvjax.load_hf), or give "
                         "KVzip(config, prompts=RepeatPrompts(...))")
    import transformers

    return RepeatPrompts.from_tokenizer(transformers.AutoTokenizer.from_pretrained(folder))


@struct.dataclass
class _Replay:
    """The repeat pass's backend state: the context cache (read only) and the scores so far."""

    k: tuple                     # per layer [B, K, T, D], the dense context keys (post-RoPE)
    v: tuple
    context: jax.Array           # int32 [B]: n_b
    lo: jax.Array                # int32 [B]: the chunk reconstructed
    hi: jax.Array
    length: jax.Array            # int32 [B]: repeat tokens of each row (0: no chunk here)
    scores: jax.Array            # float32 [L, B, K, T]
    wo: tuple | None = None      # KVzip+: per layer the output projection [H, D, E]


def _replay_backend(layer: int, q_BRHD, k_BRKD, v_BRKD, positions_BR, st: _Replay, *, sinks: int, block: int,
                    hidden_BSE=None):
    """Normal attention of the repeat queries (the whole context + the repeat so far) and, in the
    same blocks, the scores of the module docstring written into ``st.scores[layer]`` (KVzip+'s
    when ``st.wo`` is given: each weight divided by its query's ``||h_i||`` and multiplied by
    ``||W_O[g] v_t||``)."""
    B, R, H, D = q_BRHD.shape
    K = k_BRKD.shape[2]
    G = H // K
    T = st.k[layer].shape[2]
    scale = D ** -0.5
    ctx_k, ctx_v = st.k[layer].astype(jnp.float32), st.v[layer].astype(jnp.float32)            # [B, K, T, D]
    rep_k = jnp.swapaxes(k_BRKD, 1, 2).astype(jnp.float32)                                    # [B, K, R, D]
    rep_v = jnp.swapaxes(v_BRKD, 1, 2).astype(jnp.float32)
    t = jnp.arange(T)[None, :]
    ctx_all = t < st.context[:, None]                                                          # [B, T]
    ctx_sub = ctx_all & ((t < jnp.minimum(sinks, st.lo)[:, None]) | ((t >= st.lo[:, None]) & (t < st.hi[:, None])))
    chunk = (t >= st.lo[:, None]) & (t < st.hi[:, None])
    nb = -(-R // block)
    q = jnp.pad(q_BRHD, ((0, 0), (0, nb * block - R), (0, 0), (0, 0))).astype(jnp.float32)
    q = q.reshape(B, nb, block, K, G, D)
    if st.wo is not None:        # KVzip+: 1 / ||h_i|| per repeat query, ||W_O[k, g] v_t|| per context slot
        wo = st.wo[layer].astype(jnp.float32).reshape(K, G, D, -1)
        out_norm = jnp.linalg.norm(jnp.einsum("bktd,kgde->bkgte", ctx_v, wo), axis=-1)          # [B, K, G, T]
        inv_h = 1.0 / jnp.linalg.norm(hidden_BSE.astype(jnp.float32), axis=-1)                 # [B, R]
        inv_h = jnp.pad(inv_h, ((0, 0), (0, nb * block - R))).reshape(B, nb, block)
    else:
        out_norm, inv_h = None, jnp.ones((B, nb, block), jnp.float32)

    def one(best, i):
        qb = q[:, i]                                                                           # [B, b, K, G, D]
        rows = i * block + jnp.arange(block)                                                   # repeat index
        live = rows[None, :] < st.length[:, None]                                              # [B, b]
        lc = jnp.einsum("bqkgd,bktd->bkgqt", qb, ctx_k) * scale
        lr = jnp.einsum("bqkgd,bksd->bkgqs", qb, rep_k) * scale
        causal = (jnp.arange(R)[None, :] <= rows[:, None])[None] & (jnp.arange(R)[None, None, :] < st.length[:, None, None])
        neg = jnp.float32(-1e30)
        lc = jnp.where(ctx_all[:, None, None, None, :], lc, neg)
        lr = jnp.where(causal[:, None, None], lr, neg)
        # one exponential per logit serves both softmaxes: they differ in their denominators only
        # (the scores' omits the context outside the sinks and the chunk), and a softmax does
        # not depend on the maximum subtracted
        m = jnp.maximum(lc.max(-1), lr.max(-1))[..., None]
        pc, pr = jnp.exp(lc - m), jnp.exp(lr - m)
        z_rep = pr.sum(-1, keepdims=True)
        z = pc.sum(-1, keepdims=True) + z_rep                                                 # [B, K, G, b, 1]
        z_sub = jnp.where(ctx_sub[:, None, None, None, :], pc, 0.0).sum(-1, keepdims=True) + z_rep
        out = (jnp.einsum("bkgqt,bktd->bqkgd", pc, ctx_v) + jnp.einsum("bkgqs,bksd->bqkgd", pr, rep_v)) \
            / jnp.moveaxis(z, 3, 1)                                                            # [B, b, K, G, 1]
        weight = inv_h[:, i][:, None, None, :, None] / z_sub                                   # [B, K, G, b, 1]
        ps = jnp.where(live[:, None, None, :, None] & chunk[:, None, None, None, :], pc * weight, 0.0)
        if st.wo is not None:
            ps = ps * out_norm[:, :, :, None, :]
        return jnp.maximum(best, ps.max(axis=(2, 3))), out.reshape(B, block, H, D)

    best, outs = jax.lax.scan(one, jnp.zeros((B, K, T), jnp.float32), jnp.arange(nb))
    out = jnp.swapaxes(outs, 0, 1).reshape(B, nb * block, H, D)[:, :R].astype(q_BRHD.dtype)
    scores = st.scores.at[layer].set(jnp.where(chunk[:, None, :], best, st.scores[layer]))
    return out, st.replace(scores=scores)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("sinks", "block"))
def _replay(graphdef, params, st: _Replay, tokens_BR, positions_BR, *, sinks: int, block: int) -> jax.Array:
    model = nnx.merge(graphdef, params)
    backend = functools.partial(_replay_backend, sinks=sinks, block=block)
    backend.takes_hidden = st.wo is not None
    _, st = model(tokens_BR, positions_BR, backend, st)
    return st.scores


def reconstruction_scores(model, dense_k, dense_v, contexts, prompts: RepeatPrompts, *, block: int = 256,
                          plus: bool = False):
    """``float32 [L, B, K, T]``: KVzip's score of every context token (module docstring) from the
    dense context cache (``dense_k``/``dense_v``: per layer ``[B, K, T, D]``, slot = position) of
    ``contexts`` (token lists, each at most ``T`` long); 0 past a row's context. ``plus``: KVzip+'s
    normalisation (kvpress's ``kvzip_plus_normalization``): each attention weight ``a_{g,i,t}``
    becomes ``a_{g,i,t} ||W_O[g] v_t|| / ||h_i||`` before the max, ``h_i`` the layer's normalised
    input at repeat query ``i`` and ``W_O[g]`` query head ``g``'s slice of the output projection."""
    from kvjax.sampling import bucket

    cfg = model.config
    B, T = len(contexts), dense_k[0].shape[2]
    n = np.asarray([len(c) for c in contexts], np.int32)
    if n.max() > T:
        raise ValueError(f"kvzip: a context of {n.max()} tokens does not fit the {T}-slot cache")
    passes = []                                         # per chunk index: [(row, lo, hi, repeat ids)]
    for b, ctx in enumerate(contexts):
        body = list(ctx[prompts.head:])
        chunks = [body[i:i + prompts.chunk] for i in range(0, len(body), prompts.chunk)]
        for c, ids in enumerate(chunks):
            ask = prompts.first if c == 0 else prompts.later + tuple(chunks[c - 1][-prompts.postfix:])
            lo = prompts.head + c * prompts.chunk
            while len(passes) <= c:
                passes.append([])
            passes[c].append((b, lo, lo + len(ids), list(ask) + list(prompts.suffix) + ids))
    graphdef, params = nnx.split(model)
    Tc = min(T, bucket(int(n.max())))             # the repeat reads the contexts' slots only, not the cache's rest
    dense_k, dense_v = (tuple(x[:, :, :Tc] for x in kv) for kv in (dense_k, dense_v))
    scores = jnp.zeros((cfg.num_layers, B, cfg.num_kv_heads, Tc), jnp.float32)
    wo = tuple(block_.self_attn.o_proj[...] for block_ in model.layers) if plus else None
    for rows in passes:
        R = bucket(max(len(r[3]) for r in rows))
        tokens = np.zeros((B, R), np.int32)
        lo, hi, length = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        for b, a, e, ids in rows:
            tokens[b, :len(ids)], lo[b], hi[b], length[b] = ids, a, e, len(ids)
        positions = n[:, None] + np.arange(R)[None, :]
        if positions.max() >= cfg.max_position_embeddings:
            raise ValueError(f"kvzip: the reconstruction of a {n.max()}-token context reaches position "
                             f"{positions.max()}, past the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        st = _Replay(tuple(dense_k), tuple(dense_v), jnp.asarray(n), jnp.asarray(lo), jnp.asarray(hi),
                     jnp.asarray(length), scores, wo)
        scores = _replay(graphdef, params, st, jnp.asarray(tokens), jnp.asarray(positions, jnp.int32),
                         sinks=prompts.sinks, block=block)
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, T - Tc)))
    first = jnp.arange(T)[None, None, None, :] < min(prompts.sinks, int(n.min()))
    return jnp.where(first, scores.max() + 1.0, scores)


@register
@dataclasses.dataclass(frozen=True)
class KVzip(StaticPriority):
    """``kvzip``: priorities from the reconstruction pass (module docstring). ``params`` once
    scored: ``{"scores": float [L, B, K, T], "context": int [B]}`` (and, bounded throughout, each
    head's long-range budget ``"budgets": int [L, B, K]``). The budget is one top-k over all layers
    and heads unless ``config.budgets`` is ``"layer"``. ``prompts``: the repeat request's ids
    (default: built from the model's tokenizer).

    Prefill compression (``kvjax.prompt_compressed``) is KVzip's setting: the context is scored
    and compressed once. Bounded throughout (``kvjax.generate(..., policy=kvzip)``), the whole
    prompt is scored by the same pass before it is fed; the prompt's kept sets follow those scores
    (a query sees its sinks, window and the best-scored earlier tokens, as an oracle would), each
    head's long-range budget is its share of the top ``L K topk`` prompt tokens plus an even share
    of the slots no prompt token took (the cache holds ``k_max`` = the largest budget per head),
    and generated tokens, which no pass scored, rank below every prompt token: they keep only
    slots that no prompt token wants."""

    name: ClassVar[str] = "kvzip"
    table_priorities: ClassVar[bool] = True           # priorities known before the pass that uses them
    comparable_priorities: ClassVar[bool] = True      # attention probabilities: one scale for every head
    plus: ClassVar[bool] = False                      # KVzip+'s normalisation (:class:`KVzipPlus`)
    prompts: RepeatPrompts | None = None

    def effective(self) -> EvictionConfig:
        c = self.config
        if c.budgets not in ("uniform", "global", "layer"):
            raise ValueError(f"kvzip: budgets must be 'global' (the default) or 'layer', got {c.budgets!r}")
        return dataclasses.replace(c, budgets="global") if c.budgets == "uniform" else c

    def scored(self, model, dense_k, dense_v, contexts) -> "KVzip":
        """This policy with its scores for ``contexts`` (the dense context cache given)."""
        prompts = self.prompts or repeat_prompts_for(model)
        scores = reconstruction_scores(model, dense_k, dense_v, contexts, prompts, plus=self.plus)
        return dataclasses.replace(self, prompts=prompts, params={
            "scores": scores, "context": jnp.asarray([len(c) for c in contexts], jnp.int32)})

    def prepare(self, model, tokens_BS, lengths_B) -> "KVzip":
        """Bounded throughout: score each whole prompt, then split the long-range slots."""
        if self.params is not None:
            return self
        from kvjax.eviction.prompt_compressed import _context_cache, shared_keep_context
        from kvjax.sampling import bucket

        n = np.asarray(lengths_B)
        prompts = [np.asarray(tokens_BS[b, :n[b]]).tolist() for b in range(len(n))]
        padded = np.zeros((len(n), bucket(int(n.max()))), np.int32)
        for b, row in enumerate(prompts):
            padded[b, :len(row)] = row
        graphdef, params = nnx.split(model)
        dense = _context_cache(graphdef, params, jnp.asarray(padded))
        done = self.scored(model, dense.k, dense.v, prompts)
        ev = self.effective()
        S = done.params["scores"].shape[-1]
        kept = shared_keep_context(done.params["scores"], jnp.asarray(n), jnp.asarray(n * 0 + ev.budget),
                                   sinks=ev.sinks, window=ev.window, scope=ev.budgets)
        t = np.arange(S)[None, None, None, :]
        eligible = (t >= ev.sinks) & (t < (n - ev.window)[None, :, None, None])
        budgets = np.asarray(kept & eligible).sum(-1).astype(np.int32)                 # [L, B, K]
        L, _, K = budgets.shape                  # slots no prompt token took: an even share each
        budgets = budgets + np.maximum(L * K * ev.topk - budgets.sum(axis=(0, 2)), 0)[None, :, None] // (L * K)
        k_max = max(int(budgets.max()), ev.topk) if self.config.k_max is None else self.config.k_max
        return dataclasses.replace(done, config=dataclasses.replace(self.config, k_max=k_max),
                                   params={**done.params, "budgets": jnp.asarray(np.minimum(budgets, k_max))})

    def head_budgets(self, params, cfg, batch: int):
        """Bounded throughout: the split :meth:`prepare` made (prefill compression splits the
        context's slots itself and reads none)."""
        if isinstance(params, dict) and "budgets" in params:
            return params["budgets"]
        return super().head_budgets(params, cfg, batch)

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        if params is None:
            raise ValueError("kvzip scores a context by a reconstruction pass, which kvjax.generate runs (under "
                             "prefill compression: kvjax.prompt_compressed(policy, ratio, context_lengths)); "
                             "score it yourself with policy.prepare(model, tokens, lengths)")
        table = params["scores"][layer]                                              # [B, K, T]
        idx = jnp.clip(t_BS, 0, table.shape[-1] - 1)[:, None, :]
        got = jnp.take_along_axis(table, jnp.broadcast_to(idx, table.shape[:2] + idx.shape[-1:]), axis=-1)
        return jnp.where(t_BS[:, None, :] < params["context"][:, None, None], got, -1.0)   # unscored: below all


@register
@dataclasses.dataclass(frozen=True)
class KVzipPlus(KVzip):
    """``kvzip_plus``: :class:`KVzip` with KVzip+'s normalisation (:func:`reconstruction_scores`
    with ``plus=True``): a token's reconstruction attention weighted by how much its value writes
    into the residual stream, ``||W_O v_t||``, over the reading query's ``||h_i||``."""

    name: ClassVar[str] = "kvzip_plus"
    plus: ClassVar[bool] = True
