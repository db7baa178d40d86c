"""Dense forward and jitted generation (prefill + ``lax.while_loop`` decode, one ``jax.jit``).

Prompts of different lengths are moved to start at position 0 of their row (right
padding internally); the result is laid out as ``transformers`` returns it: each row
left-padded to the longest prompt, then the new tokens, and ``pad`` after a row's EOS.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kvjax import decode
from kvjax.cache import DenseKV
from kvjax.models.decoder import Decoder
from kvjax.sampling import bucket, check_sampling, sample_logits


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens_BS):
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens_BS)
    return model.logits(hidden)


def forward(model: Decoder, tokens) -> jax.Array:
    """Dense causal logits ``float32 [B, S, V]`` for ``int [B, S]`` tokens."""
    _check_token_ids(tokens)
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if tokens.shape[1] > model.config.max_position_embeddings:
        raise ValueError(f"tokens: {tokens.shape[1]} positions exceed the model's max_position_embeddings="
                         f"{model.config.max_position_embeddings}")
    _check_vocab(np.asarray(tokens), model.config.vocab_size)
    graphdef, params = nnx.split(model)
    return _forward(graphdef, params, tokens.astype(jnp.int32))


def resolve_policy(policy, length: int | None = None, compression: float | None = None):
    """``None`` -> the dense cache; a registered name -> that policy at
    :func:`kvjax.make_policy`'s default budget (75% of the prompt evicted); with ``length`` (the
    prompt's), a policy whose budget is a compression ratio (its own, or ``compression``, which
    overrides it) gets the fixed budget of that ratio at that length."""
    if policy is None:
        if compression is not None:
            raise ValueError("compression needs a policy (policy=None is the dense cache, which evicts nothing)")
        return DenseKV()
    if isinstance(policy, str):
        from kvjax.eviction.policies import make_policy

        policy = make_policy(policy)
    if not (hasattr(policy, "init") and hasattr(policy, "backend")):
        raise TypeError(f"policy must be None, a registered policy name or a policy object, got {policy!r}")
    if length is not None and hasattr(policy, "at_compression"):
        if compression is not None:
            return policy.at_compression(compression, length)
        return policy.resolved(length)
    if compression is not None:
        raise ValueError(f"compression: policy {getattr(policy, 'name', policy)!r} has no at_compression()")
    return policy


def prefill_mode(policy) -> str:
    """How ``policy``'s prompt enters the cache (``EvictionConfig.prefill``; ``"auto"`` for the
    dense cache and for a policy built already compressed)."""
    config = getattr(policy, "config", None)
    return getattr(config, "prefill", "auto")


def _compressed(policy, compression, lengths_B):
    """``policy`` under ``prefill="compressed"``: each row's prompt compressed once at the ratio."""
    from kvjax.eviction.prompt_compressed import prompt_compressed

    ratio = compression if compression is not None else getattr(policy, "compression", None)
    if ratio is None:
        raise ValueError(f"policy {policy.name!r} has prefill='compressed', which keeps a share of each prompt: "
                         "give generate(..., compression=c) or make the policy with a compression ratio")
    ranker = policy.at_compression(ratio, int(np.max(lengths_B)))
    return prompt_compressed(ranker, ratio, lengths_B)


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """What a :func:`generate` call held in its KV cache (``return_stats=True``)."""

    policy: str                 # the policy's name ("dense": no policy)
    prompt_length: int          # the longest prompt, in tokens
    new_tokens: int             # max_new_tokens
    slots_per_head: int         # KV entries each layer and KV head holds at most
    kv_bytes: int               # bytes of keys and values the cache holds (all layers and rows)
    dense_kv_bytes: int         # the same for a dense cache of prompt + new tokens

    @property
    def saved(self) -> float:
        """The share of the dense cache's bytes not held."""
        return 1.0 - self.kv_bytes / self.dense_kv_bytes

    def __str__(self) -> str:
        return (f"{self.policy}: KV cache {self.kv_bytes / 1e6:.1f} MB ({self.slots_per_head} slots per head) "
                f"against {self.dense_kv_bytes / 1e6:.1f} MB dense for {self.prompt_length} + {self.new_tokens} "
                f"tokens ({self.saved:.0%} saved)")


def generation_stats(model, policy, batch: int, prompt_length: int, new_tokens: int) -> GenerationStats:
    """The KV bytes ``policy`` holds for ``batch`` rows against a dense cache of
    ``prompt_length + new_tokens`` positions."""
    cfg = model.config
    per_slot = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(model.dtype).itemsize
    n = prompt_length + new_tokens
    from kvjax.eviction.prompt_compressed import PromptCompressed

    if isinstance(policy, (DenseKV, PromptCompressed)):      # compressed: evicted entries masked in a dense cache
        slots, kv = n, per_slot * n
    else:
        ev = policy.effective()
        slots = min(ev.sinks + ev.window + ev.slots, n)
        kv = policy.kv_bytes(cfg, batch, model.dtype)
    return GenerationStats(getattr(policy, "name", "dense"), prompt_length, new_tokens, slots, kv, per_slot * n)


def _check_vocab(tokens: np.ndarray, vocab: int) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}), got range [{tokens.min()}, {tokens.max()}]")


def normalize_prompt(prompt, attention_mask=None, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens int32 [B, S] starting at position 0 in every row, lengths int32 [B])``.

    ``prompt``: a list of token lists (ragged), or ``[B, S]`` ids with an optional
    ``attention_mask`` (1 = real token; left or right padding).
    """
    if isinstance(prompt, (list, tuple)) and prompt and not np.isscalar(prompt[0]):
        rows = [np.asarray(r, dtype=np.int64).reshape(-1) for r in prompt]
        lengths = np.array([len(r) for r in rows], np.int32)
        tokens = np.full((len(rows), max(int(lengths.max()), 1)), pad_id, np.int64)
        for b, r in enumerate(rows):
            tokens[b, :len(r)] = r
    else:
        tokens = np.asarray(prompt, dtype=np.int64)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2:
            raise ValueError(f"prompt must be [batch, seq] or a list of token lists, got shape {tokens.shape}")
        if attention_mask is None:
            lengths = np.full(tokens.shape[0], tokens.shape[1], np.int32)
        else:
            mask = np.asarray(attention_mask).astype(bool)
            if mask.shape != tokens.shape:
                raise ValueError(f"attention_mask shape {mask.shape} does not match prompt shape {tokens.shape}")
            order = np.argsort(~mask, axis=1, kind="stable")   # real tokens first, in order
            tokens = np.where(np.take_along_axis(mask, order, 1), np.take_along_axis(tokens, order, 1), pad_id)
            lengths = mask.sum(1).astype(np.int32)
    if tokens.shape[0] == 0:
        raise ValueError("prompt has no rows")
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"prompt row {int(empty[0])} is empty; every row needs at least one token")
    return tokens.astype(np.int32), lengths


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("new_cap", "eos_ids", "pad_id", "cache_len"))
def _generate(graphdef, policy, params, policy_params, tokens_BS, lengths_B, key, max_new, temperature, top_k,
              top_p, *, new_cap: int, eos_ids: tuple[int, ...], pad_id: int, cache_len: int):
    """New tokens ``int32 [B, new_cap]``: the first ``max_new`` are generated, the rest ``pad_id``.

    ``tokens_BS`` may carry right padding past every row's length (the length bucket);
    ``max_new`` and the sampling knobs are traced, so only the shapes pick a program.
    """
    model = nnx.merge(graphdef, params)
    B = tokens_BS.shape[0]
    attend = decode.bind(policy, policy_params)
    state = decode.open_state(model, policy, policy_params, B, cache_len, lengths_B, key=key)
    hidden, state = decode.feed_prompt(model, attend, state, tokens_BS, lengths_B)
    key, sub = jax.random.split(state.key)
    pick = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    state = state.replace(token=pick(decode.last_logits(model, hidden, lengths_B), sub), key=key)
    return decode_loop(model, attend, state, max_new, pick, new_cap=new_cap, eos_ids=eos_ids, pad_id=pad_id)


@struct.dataclass
class Generation:
    """The carry of generation: the decode state and the new tokens so far."""

    state: decode.DecodeState
    out: jax.Array              # int32 [B, new_cap]


def decode_loop(model, attend, state: decode.DecodeState, max_new, pick, *, new_cap: int,
                eos_ids: tuple[int, ...], pad_id: int):
    """The decode ``lax.while_loop`` (inside a jit): ``state.token`` is every row's first new
    token, fed at ``state.position``; stops when every row has emitted an EOS or ``max_new``
    tokens. Returns the new tokens ``int32 [B, new_cap]`` (``pad_id`` after EOS)."""
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    B = state.token.shape[0]

    def cond(g: Generation):
        return (g.state.step < max_new) & ~jnp.all(g.state.done)

    def body(g: Generation):
        st = g.state
        tok = jnp.where(st.done, pad_id, st.token)
        out = g.out.at[:, st.step].set(tok)
        done = st.done | jnp.isin(tok, eos)
        logits, st = decode.decode_step(model, attend, st, tok)
        key, sub = jax.random.split(st.key)
        return Generation(st.replace(token=pick(logits, sub), done=done, key=key), out)

    init = Generation(state, jnp.full((B, new_cap), pad_id, jnp.int32))
    return jax.lax.while_loop(cond, body, init).out


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("new_cap", "eos_ids", "pad_id", "cache_len"))
def _generate_stepwise(graphdef, policy, params, policy_params, tokens_BS, lengths_B, key, max_new, temperature,
                       top_k, top_p, *, new_cap: int, eos_ids: tuple[int, ...], pad_id: int, cache_len: int):
    """Like :func:`_generate`, but the prompt too goes token by token through the decode path:
    at step ``i`` every row feeds its token at position ``i`` (its prompt's, or the token it
    generated last once its prompt is done), so every query, prompt included, sees only what
    the policy keeps (bounded throughout, whatever the policy's prefill does)."""
    model = nnx.merge(graphdef, params)
    B, S = tokens_BS.shape
    attend = decode.bind(policy, policy_params)
    state = decode.open_state(model, policy, policy_params, B, cache_len, jnp.ones((B,), jnp.int32), key=key)
    state = state.replace(token=tokens_BS[:, 0])
    pick = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    rows = jnp.arange(B)

    def cond(g: Generation):
        return (g.state.step < S + max_new - 1) & ~jnp.all(g.state.done)

    def body(g: Generation):
        st = g.state
        i = st.step
        tok = jnp.where(i < lengths_B, tokens_BS[:, jnp.minimum(i, S - 1)], st.token)
        logits, st = decode.decode_step(model, attend, st, tok)
        key, sub = jax.random.split(st.key)
        nxt = pick(logits, sub)
        j = i + 1 - lengths_B                                  # nxt is new token j of its row
        live = (j >= 0) & (j < max_new) & ~st.done
        col = jnp.clip(j, 0, new_cap - 1)
        out = g.out.at[rows, col].set(jnp.where(live, nxt, g.out[rows, col]))
        done = st.done | (live & jnp.isin(nxt, eos)) | (j >= max_new - 1)
        return Generation(st.replace(token=nxt, done=done, key=key), out)

    init = Generation(state, jnp.full((B, new_cap), pad_id, jnp.int32))
    return jax.lax.while_loop(cond, body, init).out


def _hf_layout(tokens_BS: np.ndarray, lengths_B: np.ndarray, new_BN: np.ndarray, pad_id: int) -> np.ndarray:
    """``[B, S + N]`` as ``transformers`` returns it: ``[pad * (S - len), prompt, new tokens]``."""
    B, S = tokens_BS.shape
    out = np.full((B, S + new_BN.shape[1]), pad_id, np.int32)
    for b, n in enumerate(lengths_B):
        out[b, S - n:S] = tokens_BS[b, :n]
    out[:, S:] = new_BN
    return out


def _check_token_ids(prompt) -> None:
    """Token ids must be integers: ``[4.9, 12.2]`` is an error, not ``[4, 12]``."""
    if hasattr(prompt, "dtype"):
        if not (np.issubdtype(prompt.dtype, np.integer) and prompt.dtype != np.bool_):
            raise TypeError(f"prompt token ids must be integers, got dtype {prompt.dtype}")
        return
    rows = prompt if isinstance(prompt, (list, tuple)) else [prompt]
    for row in rows:
        for x in (row if isinstance(row, (list, tuple)) else np.ravel(row)):
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                raise TypeError(f"prompt token ids must be integers, got {x!r} ({type(x).__name__})")


def generate(model: Decoder, prompt, max_new_tokens: int, *, policy=None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, attention_mask=None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             max_cache_len: int | None = None, bucket_lengths: bool = True, compression: float | None = None,
             return_stats: bool = False):
    """Jitted prefill + decode -> ``int32 [B, S + max_new_tokens]`` (with ``return_stats``, also
    a :class:`GenerationStats`: the KV bytes held against a dense cache).

    ``policy=None`` is the dense cache; otherwise a policy object (e.g.
    ``kvjax.make_policy("h2o", kvjax.EvictionConfig(4, 64, 64))``) or a registered name (at the
    default budget, 75% of the prompt evicted). ``compression`` sets the budget of any policy as
    the share of the prompt evicted: ``round((1 - compression) S)`` slots per KV head for the
    longest prompt ``S`` (its sinks and window, the rest long-range; learned per-head budgets
    rescaled); a policy made or loaded with a compression ratio resolves it the same way. The
    budget is a static shape: each prompt length compiles its own program.
    Greedy when ``temperature == 0``, otherwise sampling with ``jax.random.key(seed)``,
    filtered by ``top_k`` (0 = off) and ``top_p`` (1 = off). Rows stop at EOS (default: the
    model's) and are padded with ``pad_token_id`` (default: the model's pad, else its EOS,
    else 0). With ``bucket_lengths`` (default) the prompt and generation lengths are padded
    up to shared sizes (:func:`kvjax.sampling.bucket`) inside, so calls with many different
    lengths reuse a bounded number of compiled programs; the tokens are the same.

    How the prompt enters the cache is the policy's setting, ``EvictionConfig.prefill``
    (``policy.with_prefill(mode)``): ``"auto"`` (default) one pass: the dense cache attends
    densely, policies with static priorities keep their budget already in the prompt (keep-rule
    attention), and attention-statistic policies (SnapKV, H2O, TOVA) attend densely and
    compress when the prompt ends; ``"chunked"`` the same kept sets ``prefill_chunk`` queries at
    a time; ``"stepwise"`` the prompt token by token through the decode path, so every policy is
    bounded throughout (slower: one step per prompt token); ``"compressed"`` kvpress's setting:
    a dense prefill, each row's prompt compressed once to ``round((1 - c) n_b)`` entries per
    head, and nothing evicted afterwards (the compression ``c`` from ``compression`` or the
    policy's own; the evicted entries are masked in a dense cache, so ``return_stats`` reports
    no bytes saved; :func:`kvjax.eviction.shared_prefill.answer` drops them).
    """
    cfg = model.config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    eos = cfg.eos_ids if eos_token_id is None else (
        (eos_token_id,) if isinstance(eos_token_id, (int, np.integer)) else tuple(eos_token_id))
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    _check_token_ids(prompt)
    tokens, lengths = normalize_prompt(prompt, attention_mask, pad_token_id)
    _check_vocab(tokens, cfg.vocab_size)
    S, max_new = tokens.shape[1], int(max_new_tokens)
    need = S + max_new
    if S > cfg.max_position_embeddings:
        raise ValueError(f"prompt: {S} tokens exceed the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}; shorten the prompt")
    if max_cache_len is not None and need > max_cache_len:
        raise ValueError(f"max_new_tokens: prompt length {S} + max_new_tokens {max_new_tokens} "
                         f"= {need} exceeds the cache size max_cache_len={max_cache_len}")
    if need > cfg.max_position_embeddings:
        raise ValueError(f"max_new_tokens: prompt length {S} + max_new_tokens {max_new_tokens} "
                         f"= {need} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}")
    if isinstance(policy, str):
        policy = resolve_policy(policy)
    if prefill_mode(policy) == "compressed":
        policy = _compressed(policy, compression, lengths)
    else:
        policy = resolve_policy(policy, S, compression)
    if hasattr(policy, "check_model"):
        policy.check_model(cfg)
    if hasattr(policy, "prepare"):             # a ranker with a pass of its own (KVzip's reconstruction)
        policy = policy.prepare(model, tokens, lengths)
    S_b, N_b = (bucket(S), bucket(max_new)) if bucket_lengths else (S, max_new)
    padded = np.full((tokens.shape[0], S_b), pad_token_id, np.int32)
    padded[:, :S] = tokens
    graphdef, params = nnx.split(model)
    run = _generate_stepwise if prefill_mode(policy) == "stepwise" else _generate
    new = run(graphdef, policy, params, policy.params, jnp.asarray(padded), jnp.asarray(lengths),
                    jax.random.key(seed), jnp.int32(max_new), jnp.float32(temperature), jnp.int32(top_k),
                    jnp.float32(top_p), new_cap=N_b, eos_ids=tuple(int(e) for e in eos),
                    pad_id=int(pad_token_id), cache_len=max_cache_len or (S_b + N_b))
    out = jnp.asarray(_hf_layout(tokens, lengths, np.asarray(new)[:, :max_new], int(pad_token_id)))
    if return_stats:
        return out, generation_stats(model, policy, tokens.shape[0], S, max_new)
    return out
