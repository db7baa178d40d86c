"""Dense forward and jitted generation (prefill + ``lax.while_loop`` decode, one ``jax.jit``).

Prompts of different lengths are moved to start at position 0 of their row (right
padding internally); the result is laid out as ``transformers`` returns it: each row
left-padded to the longest prompt, then the new tokens, and ``pad`` after a row's EOS.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.cache import DenseCache, dense_cache_attention
from kvjax.models.decoder import Decoder


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens_BS):
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens_BS)
    return model.logits(hidden)


def forward(model: Decoder, tokens) -> jax.Array:
    """Dense causal logits ``float32 [B, S, V]`` for ``int [B, S]`` tokens."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    _check_vocab(np.asarray(tokens), model.config.vocab_size)
    graphdef, params = nnx.split(model)
    return _forward(graphdef, params, tokens.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class DenseKV:
    """The dense cache as a cache policy: ``init`` a state, attend through ``backend``."""

    name: str = "dense"

    params: Any = None

    def init(self, params, cfg, batch: int, max_len: int, dtype, lengths) -> Any:
        return DenseCache.init(cfg, batch, max_len, dtype)

    def backend(self, params, layer, q, k, v, positions, state):
        return dense_cache_attention(layer, q, k, v, positions, state)


def resolve_policy(policy):
    """``None`` -> the dense cache; a registered name -> that policy with the default budget."""
    if policy is None:
        return DenseKV()
    if isinstance(policy, str):
        from kvjax.eviction.policies import make_policy

        return make_policy(policy)
    if not (hasattr(policy, "init") and hasattr(policy, "backend")):
        raise TypeError(f"policy must be None, a registered policy name or a policy object, got {policy!r}")
    return policy


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


def _sample(logits_BV, key, temperature):
    greedy = jnp.argmax(logits_BV, axis=-1)
    sampled = jax.random.categorical(key, logits_BV / jnp.maximum(temperature, 1e-6), axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("max_new", "eos_ids", "pad_id", "cache_len"))
def _generate(graphdef, policy, params, policy_params, tokens_BS, lengths_B, key, temperature, *,
              max_new: int, eos_ids: tuple[int, ...], pad_id: int, cache_len: int):
    model = nnx.merge(graphdef, params)
    B, S = tokens_BS.shape
    state = policy.init(policy_params, model.config, B, cache_len, model.dtype, lengths_B)
    backend = functools.partial(policy.backend, policy_params)
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    hidden, state = model(tokens_BS, positions, backend, state)
    last = jnp.take_along_axis(hidden, (lengths_B - 1)[:, None, None], axis=1)
    key, sub = jax.random.split(key)
    first = _sample(model.logits(last)[:, 0], sub, temperature)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def cond(c):
        i, _, done, _, _, _ = c
        return (i < max_new) & ~jnp.all(done)

    def body(c):
        i, tok, done, state, out, key = c
        tok = jnp.where(done, pad_id, tok)
        out = out.at[:, i].set(tok)
        done = done | jnp.isin(tok, eos)
        h, state = model(tok[:, None], (lengths_B + i)[:, None], backend, state)
        key, sub = jax.random.split(key)
        return i + 1, _sample(model.logits(h)[:, 0], sub, temperature), done, state, out, key

    init = (jnp.int32(0), first, jnp.zeros(B, bool), state, jnp.full((B, max_new), pad_id, jnp.int32), key)
    _, _, _, _, new_BN, _ = jax.lax.while_loop(cond, body, init)

    # transformers layout: [pad * (S - len), prompt, new tokens]
    j = jnp.arange(S + max_new)[None, :]
    src = j - (S - lengths_B)[:, None]
    from_prompt = jnp.take_along_axis(tokens_BS, jnp.clip(src, 0, S - 1), axis=1)
    from_new = jnp.take_along_axis(new_BN, jnp.clip(src - lengths_B[:, None], 0, max_new - 1), axis=1)
    return jnp.where(src < 0, pad_id, jnp.where(src < lengths_B[:, None], from_prompt, from_new))


def generate(model: Decoder, prompt, max_new_tokens: int, *, policy=None, temperature: float = 0.0,
             seed: int = 0, attention_mask=None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, max_cache_len: int | None = None) -> jax.Array:
    """Jitted prefill + decode -> ``int32 [B, S + max_new_tokens]``.

    ``policy=None`` is the dense cache; otherwise a policy object (e.g.
    ``kvjax.make_policy("h2o", kvjax.EvictionConfig(4, 64, 64))``) or a registered name.
    Greedy when ``temperature == 0``, otherwise
    sampling with ``jax.random.key(seed)``. Rows stop at EOS (default: the model's) and are
    padded with ``pad_token_id`` (default: the model's pad, else its EOS, else 0).
    """
    cfg = model.config
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    eos = cfg.eos_ids if eos_token_id is None else (
        (eos_token_id,) if isinstance(eos_token_id, (int, np.integer)) else tuple(eos_token_id))
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    tokens, lengths = normalize_prompt(prompt, attention_mask, pad_token_id)
    _check_vocab(tokens, cfg.vocab_size)
    need = tokens.shape[1] + int(max_new_tokens)
    if max_cache_len is not None and need > max_cache_len:
        raise ValueError(f"max_new_tokens: prompt length {tokens.shape[1]} + max_new_tokens {max_new_tokens} "
                         f"= {need} exceeds the cache size max_cache_len={max_cache_len}")
    if need > cfg.max_position_embeddings:
        raise ValueError(f"max_new_tokens: prompt length {tokens.shape[1]} + max_new_tokens {max_new_tokens} "
                         f"= {need} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}")
    policy = resolve_policy(policy)
    graphdef, params = nnx.split(model)
    return _generate(graphdef, policy, params, policy.params, jnp.asarray(tokens), jnp.asarray(lengths),
                     jax.random.key(seed), jnp.float32(temperature), max_new=int(max_new_tokens),
                     eos_ids=tuple(int(e) for e in eos), pad_id=int(pad_token_id),
                     cache_len=max_cache_len or need)
