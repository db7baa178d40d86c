"""The one decode engine: open a policy's cache, feed a prompt, step one token.

Every token loop in kvjax drives these three functions inside its own jit:

- :func:`open_state` initialises a policy's cache (the only caller of ``policy.init``) into a
  :class:`DecodeState`, the named loop carry;
- :func:`feed_prompt` runs a block of tokens through the model into the cache (the one-pass
  prefill, a question chunk after a compressed context);
- :func:`decode_step` feeds one token per row at its position and returns the logits.

The drivers add only their own bookkeeping: :func:`kvjax.generate.decode_loop` (sampling,
EOS, the output buffer), stepwise generation and :func:`kvjax.eviction.forced.stepwise_logits`
(a forced token per step), :mod:`kvjax.traces.stream` (continuous batching) and
:mod:`kvjax.evaluation.decode_bench` (timing). ``attend`` is a policy's attention backend with
its weights bound (:func:`bind`), or any function of the backend signature
``(layer, q, k, v, positions, cache) -> (out, cache)``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class DecodeState:
    """The carry of a token loop."""

    cache: Any                  # the policy's state (slot buffers, a dense or compact cache, ...)
    position: jax.Array         # int32 [B]: the position each row's next token is fed at
    token: jax.Array            # int32 [B]: the token each row feeds next
    done: jax.Array             # bool [B]: rows that stopped (EOS, or their last token)
    step: jax.Array             # int32 []: decode steps taken
    key: jax.Array              # the sampling key


def bind(policy, policy_params) -> Callable:
    """``policy``'s attention backend with its weights bound: the ``attend`` of every loop."""
    return functools.partial(policy.backend, policy_params)


def open_cache(policy, policy_params, cfg, batch: int, cache_len: int, dtype, filled_B) -> Any:
    """``policy``'s empty cache for ``batch`` rows of ``cache_len`` positions; ``filled_B`` (int32
    ``[B]``) is what the first call will feed each row (its prompt length; 1 when the prompt goes
    token by token)."""
    return policy.init(policy_params, cfg, batch, cache_len, dtype, jnp.asarray(filled_B, jnp.int32))


def start(cache, position_B, key=None) -> DecodeState:
    """A :class:`DecodeState` over ``cache`` whose next token goes at ``position_B``."""
    position = jnp.asarray(position_B, jnp.int32)
    B = position.shape[0]
    return DecodeState(cache, position, jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool), jnp.int32(0),
                       jax.random.key(0) if key is None else key)


def open_state(model, policy, policy_params, batch: int, cache_len: int, filled_B, *, position_B=None,
               key=None) -> DecodeState:
    """:func:`open_cache` for ``model`` as a :class:`DecodeState` at ``position_B`` (default 0)."""
    cache = open_cache(policy, policy_params, model.config, batch, cache_len, model.dtype, filled_B)
    return start(cache, jnp.zeros((batch,), jnp.int32) if position_B is None else position_B, key)


def feed_prompt(model, attend, state: DecodeState, tokens_BS, lengths_B) -> tuple[jax.Array, DecodeState]:
    """Feed ``tokens_BS`` (row ``b``'s first ``lengths_B[b]`` real, the rest padding) at positions
    ``state.position ..``; returns ``(hidden float [B, S, D], state)`` with every row's position
    past its real tokens. A block starting at position 0 is a prompt into an empty cache (the
    backends' one-pass prefill)."""
    B, S = tokens_BS.shape
    positions = state.position[:, None] + jnp.arange(S)[None, :]
    hidden, cache = model(tokens_BS, positions, attend, state.cache)
    return hidden, state.replace(cache=cache, position=state.position + jnp.asarray(lengths_B, jnp.int32))


def last_logits(model, hidden_BSD, lengths_B) -> jax.Array:
    """``float32 [B, V]``: the logits after each row's last real token of a fed block."""
    last = jnp.take_along_axis(hidden_BSD, (jnp.asarray(lengths_B) - 1)[:, None, None], axis=1)
    return model.logits(last)[:, 0]


def decode_step(model, attend, state: DecodeState, feed_B=None) -> tuple[jax.Array, DecodeState]:
    """One token per row: ``feed_B`` (default ``state.token``) at ``state.position``; returns
    ``(logits float32 [B, V], state)`` with the position and step advanced by one."""
    token = state.token if feed_B is None else feed_B
    h, cache = model(token[:, None], state.position[:, None], attend, state.cache)
    return model.logits(h)[:, 0], state.replace(cache=cache, position=state.position + 1, step=state.step + 1)
