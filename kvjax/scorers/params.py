"""Scorer parameter type and the shared per-head temporal decay.

Every scorer weight is a :class:`ScorerParam` (a subclass of ``nnx.Param``) with
``logical_axes`` metadata, so ``nnx.state(model, ScorerParam)`` selects exactly the
scorer weights for the optimizer, checkpoints and export. Note that a plain
``nnx.Param`` filter also matches them; select the backbone alone with
``nnx.All(nnx.Param, nnx.Not(ScorerParam))``.

Decay (docs/design.md, "The keep rule"): per KV head ``lambda_h = softplus(rho_h) >= 0``; the
decayed score at query ``q`` is ``r_t - lambda_h (q - t)``. The ``q`` cancels when two
tokens are compared at the same query, so the *static priority*
``p_t = r_t + lambda_h t`` ranks tokens as the decayed score does at every ``q``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

# rho init: softplus(-7) ~ 9e-4, a small decay per token
DECAY_RAW_INIT = -7.0


class ScorerParam(nnx.Param):
    """A learned-eviction scorer weight (selected apart from the backbone's ``nnx.Param``)."""


def scorer_param(value: jax.Array, axes: tuple[str | None, ...]) -> ScorerParam:
    """Wrap ``value`` (float32) with its logical axes."""
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match shape {value.shape}")
    return ScorerParam(value.astype(jnp.float32), logical_axes=axes)


def init_normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    """``N(0, std^2)`` drawn flat then reshaped (XLA:CPU compiles multi-axis draws for seconds)."""
    return std * jax.random.normal(rngs.params(), (math.prod(shape),), jnp.float32).reshape(shape)


def decay_param(num_layers: int, kv_heads: int) -> ScorerParam:
    """Raw decay ``rho [L, K]`` (``lambda = softplus(rho)``)."""
    return scorer_param(jnp.full((num_layers, kv_heads), DECAY_RAW_INIT), ("layers", "kv_heads"))


def stop_features(k_BSKD: jax.Array, v_BSKD: jax.Array) -> jax.Array:
    """Scorer input ``x_t = [k_t; v_t]`` in float32, detached from the backbone: ``[B, S, K, 2D]``."""
    x = jnp.concatenate([k_BSKD, v_BSKD], axis=-1)
    return jax.lax.stop_gradient(x).astype(jnp.float32)
