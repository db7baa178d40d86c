"""LKV-T: matrix-free token selection by a per-(layer, KV head) MLP on ``[k; v]``.

Dimension letters: B batch, S positions, K KV heads, D head dim, F hidden width,
X = 2D scorer input.

For layer ``l`` and KV head ``h`` (weights stacked over layers and heads):

    u_i^{(l,h)} = MLP_token^{(l,h)}([k_i; v_i]) = w2_h . silu(W1_h^T stop_gradient([k_i; v_i]) + b1_h)

The score is query-agnostic. No output bias: only the order of ``u`` (hard top-k) and
its differences (Soft-TopK is translation invariant) matter.

Training (seed, "Gumbel-Based Training"): with ``g_i`` i.i.d. standard Gumbel noise,

    m~ = ST_b(u + g; tau),   sum_i m~_i = b,

with ``tau`` annealed from high (exploration) to near zero (:func:`gumbel_temperature`).
At inference the selection is the hard top-k of ``u``: the scores are the static
priorities of the eviction cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.lkv.param import LKVParam
from kvjax.lkv.soft_topk import soft_topk


class LKVTokenScorer(nnx.Module):
    """Per-layer, per-KV-head token MLPs; all weights are ``LKVParam``.

    Hold it under an attribute named ``lkv`` so the optimiser puts it in the ``lkv`` group.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, hidden: int = 64, *, rngs: nnx.Rngs):
        for name, value in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                            ("hidden", hidden)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        L, K, X, F = num_layers, kv_heads, 2 * head_dim, hidden
        self.w1 = LKVParam(X ** -0.5 * jax.random.normal(rngs.params(), (L, K, X, F), jnp.float32),
                           logical_axes=("layers", "kv_heads", None, "scorer_hidden"))
        self.b1 = LKVParam(jnp.zeros((L, K, F), jnp.float32), logical_axes=("layers", "kv_heads", "scorer_hidden"))
        self.w2 = LKVParam(F ** -0.5 * jax.random.normal(rngs.params(), (L, K, F), jnp.float32),
                           logical_axes=("layers", "kv_heads", "scorer_hidden"))

    def scores(self, layer, k_BSKD: jax.Array, v_BSKD: jax.Array) -> jax.Array:
        """Token scores ``u`` of ``layer``: float32 ``[B, K, S]`` (inputs detached from the backbone)."""
        x_BSKX = jax.lax.stop_gradient(jnp.concatenate([k_BSKD, v_BSKD], axis=-1)).astype(jnp.float32)
        hid_BSKF = jax.nn.silu(jnp.einsum("bskx,kxf->bskf", x_BSKX, self.w1[...][layer]) + self.b1[...][layer])
        return jnp.einsum("bskf,kf->bks", hid_BSKF, self.w2[...][layer])


def gumbel_temperature(step, start: float, end: float, steps: int) -> jax.Array:
    """Geometric annealing ``tau(step) = start (end / start)^min(step / steps, 1)``: float32 scalar.

    ``tau(0) = start``, ``tau(steps) = end``, constant ``end`` afterwards; ``step`` may be traced.
    """
    if not (start > 0 and end > 0):
        raise ValueError(f"gumbel_temperature: start and end must be > 0, got start={start}, end={end}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"gumbel_temperature: steps must be a positive integer, got steps={steps!r}")
    frac = jnp.clip(jnp.asarray(step, jnp.float32) / steps, 0.0, 1.0)
    return start * jnp.exp(frac * jnp.log(jnp.float32(end / start)))


def noisy_scores(scores: jax.Array, rng: jax.Array, temperature) -> jax.Array:
    """``(u + g) / tau`` with ``g`` standard Gumbel noise (float32, the shape of ``scores``).

    ``soft_topk(noisy_scores(u, rng, tau), b)`` is the seed's ``ST_b(u + g; tau)``.
    """
    g = jax.random.gumbel(rng, jnp.shape(scores), jnp.float32)
    return (jnp.asarray(scores, jnp.float32) + g) / temperature


def gumbel_topk_mask(scores_BKS: jax.Array, budget, rng: jax.Array, temperature) -> jax.Array:
    """Training-time soft keep mask ``m~ = ST_b(u + g; tau)`` over the last (token) axis.

    ``budget`` (``0 < b < S``) is a scalar or broadcastable to ``scores.shape[:-1]`` (e.g. the
    per-head ``b_K``, possibly the soft ``r t`` to train the ratios through it). Each row of
    the result sums to its budget.
    """
    return soft_topk(noisy_scores(scores_BKS, rng, temperature), budget)
