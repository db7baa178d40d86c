"""LKV-H: learned per-(layer, KV head) retention ratios and integer budgets.

Dimension letters: L layers, K KV heads, E embedding width, F hidden width.

Each KV head ``(l, h)`` owns an embedding ``e^{(l,h)}`` (E); a shared MLP maps it to a
score, and one Soft-TopK over the flattened ``L * K`` scores (the "global 1D
competition") turns the scores into retention ratios with a fixed total:

    s^{(l,h)} = MLP_head(e^{(l,h)}) = w2 . silu(W1^T e^{(l,h)} + b1)
    r_flat = ST_{R_agg}(s_flat / tau),   R_agg = R * L * K,   sum_i r_i = R_agg

``R`` is the target keep ratio (``0 < R < 1``) and ``tau`` the Soft-TopK temperature;
each ``r^{(l,h)}`` lies in ``[0, 1]``. No output bias: ``ST`` is translation invariant.
``w2`` starts at zero, so training starts from the uniform split ``r = R``.

Budgets for a length ``t`` (the seed's ``b^{(l,h)} = floor(r^{(l,h)} t)``): see
:func:`integer_budgets`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from kvjax.lkv.param import LKVParam
from kvjax.lkv.soft_topk import soft_topk


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_keep_ratio(keep_ratio) -> float:
    if not 0.0 < float(keep_ratio) < 1.0:
        raise ValueError(f"keep_ratio must satisfy 0 < keep_ratio < 1, got keep_ratio={keep_ratio}")
    return float(keep_ratio)


def integer_budgets(r_LK: jax.Array, keep_ratio: float, length: int, k_max: int | None = None) -> jax.Array:
    """Integer budgets ``b_lh = floor(r_lh t)`` with guaranteed totals: int32 ``[L, K]``.

    1. ``b = floor(r t)``, clipped to ``[0, min(t, k_max)]`` (``k_max=None``: no per-head cap).
       A clipped head's surplus is *not* redistributed: the learned ratios are kept, and the
       total only shrinks.
    2. ``sum b <= floor(R L K t)`` holds exactly for real ``r`` (``sum r = R L K``), but
       float32 rounding of ``r t`` can push a floor one unit up; while the sum exceeds that
       total, one unit is taken from the non-empty head with the smallest fractional part
       ``r t - b`` (the one most likely rounded up).

    So ``0 <= b_lh <= min(t, k_max)`` and ``sum b <= R L K t`` always.
    """
    keep_ratio = _check_keep_ratio(keep_ratio)
    length = _positive_int("length", length)
    if k_max is not None and (not isinstance(k_max, int) or isinstance(k_max, bool) or k_max < 0):
        raise ValueError(f"k_max must be a non-negative integer or None, got {k_max!r}")
    cap = length if k_max is None else min(length, k_max)
    total = math.floor(keep_ratio * r_LK.size * length)
    return _floor_budgets(jnp.asarray(r_LK, jnp.float32), length, cap, total)


@jax.jit
def _floor_budgets(r_LK: jax.Array, length, cap, total) -> jax.Array:
    rt_H = jnp.ravel(r_LK) * length
    b_H = jnp.clip(jnp.floor(rt_H), 0, cap).astype(jnp.int32)

    def over(state):
        b, _ = state
        return jnp.sum(b) > total

    def take_one(state):
        b, frac = state
        i = jnp.argmin(jnp.where(b > 0, frac, jnp.inf))
        return b.at[i].add(-1), frac.at[i].add(1.0)

    b_H, _ = lax.while_loop(over, take_one, (b_H, rt_H - b_H))
    return b_H.reshape(r_LK.shape)


class LKVHeads(nnx.Module):
    """Head embeddings ``[L, K, E]`` and the shared head MLP; all weights are ``LKVParam``.

    Hold it under an attribute named ``lkv`` so the optimiser puts it in the ``lkv`` group.
    """

    def __init__(self, num_layers: int, kv_heads: int, embed_dim: int = 16, hidden: int = 64, *,
                 rngs: nnx.Rngs):
        L = _positive_int("num_layers", num_layers)
        K = _positive_int("kv_heads", kv_heads)
        E = _positive_int("embed_dim", embed_dim)
        F = _positive_int("hidden", hidden)
        self.embed = LKVParam(jax.random.normal(rngs.params(), (L, K, E), jnp.float32),
                              logical_axes=("layers", "kv_heads", None))
        self.w1 = LKVParam(E ** -0.5 * jax.random.normal(rngs.params(), (E, F), jnp.float32),
                           logical_axes=(None, "scorer_hidden"))
        self.b1 = LKVParam(jnp.zeros((F,), jnp.float32), logical_axes=("scorer_hidden",))
        self.w2 = LKVParam(jnp.zeros((F,), jnp.float32), logical_axes=("scorer_hidden",))

    def scores(self) -> jax.Array:
        """``s^{(l,h)} = MLP_head(e^{(l,h)})``: float32 ``[L, K]``."""
        hid_LKF = jax.nn.silu(jnp.einsum("lke,ef->lkf", self.embed[...], self.w1[...]) + self.b1[...])
        return jnp.einsum("lkf,f->lk", hid_LKF, self.w2[...])

    def ratios(self, keep_ratio: float, temperature=1.0) -> jax.Array:
        """``r = ST_{R L K}(s_flat / tau)`` reshaped to ``[L, K]``: in ``[0, 1]``, summing to ``R L K``."""
        keep_ratio = _check_keep_ratio(keep_ratio)
        s_LK = self.scores()
        return soft_topk(jnp.ravel(s_LK), keep_ratio * s_LK.size, temperature=temperature).reshape(s_LK.shape)

    def budgets(self, keep_ratio: float, length: int, k_max: int | None = None, *, temperature=1.0) -> jax.Array:
        """Integer budgets ``b_lh = floor(r_lh t)`` for length ``t``: int32 ``[L, K]`` (see :func:`integer_budgets`)."""
        return integer_budgets(self.ratios(keep_ratio, temperature), keep_ratio, length, k_max)
