"""Teacher-forced logits under a policy, two ways that must agree for static priorities:

- ``sparse_logits``: one pass over the sequence with the keep-rule mask (training/prefill);
- ``stepwise_logits``: token by token through the decode path (``append`` + slot attention),
  from an empty cache. This works for every policy, including attention heuristics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax import decode


@functools.partial(jax.jit, static_argnums=(0, 1))
def _sparse(graphdef, policy, params, policy_params, tokens_BS):
    model = nnx.merge(graphdef, params)
    B, S = tokens_BS.shape
    lengths = jnp.full((B,), S, jnp.int32)
    state = decode.open_state(model, policy, policy_params, B, S, lengths)
    h, _ = decode.feed_prompt(model, decode.bind(policy, policy_params), state, tokens_BS, lengths)
    return model.logits(h)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _stepwise(graphdef, policy, params, policy_params, tokens_BS):
    model = nnx.merge(graphdef, params)
    B, S = tokens_BS.shape
    state = decode.open_state(model, policy, policy_params, B, S, jnp.ones((B,), jnp.int32))
    attend = decode.bind(policy, policy_params)

    def step(state, tok_B):
        logits, state = decode.decode_step(model, attend, state, tok_B)
        return state, logits

    _, logits_SBV = jax.lax.scan(step, state, tokens_BS.T)
    return jnp.swapaxes(logits_SBV, 0, 1)


def sparse_logits(model, tokens_BS, policy):
    """``float32 [B, S, V]`` from one keep-rule-masked pass (static-priority policies)."""
    if not policy.static:
        raise ValueError(f"policy {policy.name!r} has time-varying scores; use stepwise_logits")
    graphdef, params = nnx.split(model)
    return _sparse(graphdef, policy, params, policy.params, jnp.asarray(tokens_BS, jnp.int32))


def stepwise_logits(model, tokens_BS, policy):
    """``float32 [B, S, V]``: each position decoded through the bounded cache."""
    graphdef, params = nnx.split(model)
    return _stepwise(graphdef, policy, params, policy.params, jnp.asarray(tokens_BS, jnp.int32))
