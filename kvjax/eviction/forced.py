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


@functools.partial(jax.jit, static_argnums=(0, 1))
def _sparse(graphdef, policy, params, policy_params, tokens_BS):
    model = nnx.merge(graphdef, params)
    B, S = tokens_BS.shape
    cache = policy.init(policy_params, model.config, B, S, model.dtype, jnp.full((B,), S, jnp.int32))
    h, _ = model(tokens_BS, None, functools.partial(policy.backend, policy_params), cache)
    return model.logits(h)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _stepwise(graphdef, policy, params, policy_params, tokens_BS):
    model = nnx.merge(graphdef, params)
    B, S = tokens_BS.shape
    cache = policy.init(policy_params, model.config, B, S, model.dtype, jnp.ones((B,), jnp.int32))
    backend = functools.partial(policy.backend, policy_params)

    def step(cache, xs):
        tok_B, q = xs
        h, cache = model(tok_B[:, None], jnp.full((B, 1), q, jnp.int32), backend, cache)
        return cache, model.logits(h)[:, 0]

    _, logits_SBV = jax.lax.scan(step, cache, (tokens_BS.T, jnp.arange(S)))
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
