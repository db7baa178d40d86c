"""Closed-form Soft-TopK ``ST_k(x)`` (LKV seed, "The Differentiable Soft-TopK Operator").

Over the last axis of ``x`` (``N`` entries; any leading batch axes), with ``x`` already
divided by the temperature and ``F`` the Laplace CDF

    F(z) = 1 - exp(-z) / 2   (z >= 0),        F(z) = exp(z) / 2   (z < 0),

``ST_k(x)_i = F(x_i - lambda)`` where the threshold ``lambda`` solves
``sum_i F(x_i - lambda) = k``. Sort ``x`` descending and let ``m`` be the number of
entries at or above ``lambda`` (``x_{m+1} <= lambda <= x_m``). Then

    m - e^lambda S1 / 2 + e^-lambda S2 / 2 = k,
    S1 = sum_{i<=m} exp(-x_i),   S2 = sum_{i>m} exp(x_i),

a quadratic in ``e^lambda`` whose positive root is the seed's closed form

    lambda = log( (sqrt((k-m)^2 + S1 S2) - (k-m)) / S1 ).

Anchored forms. With ``x_m`` the smallest entry above the threshold and ``x_{m+1}``
the largest below it, write ``S1 = e^{-x_m} A`` and ``S2 = e^{x_{m+1}} B`` where

    A = sum_{i<=m} exp(-|x_i - x_m|) in [1, m],    B = sum_{i>m} exp(-|x_i - x_{m+1}|) in [1, N-m],

so ``P = S1 S2 = e^{x_{m+1} - x_m} A B <= m (N-m)`` never overflows. With ``a = k - m``
and ``h = log(|a| + sqrt(a^2 + P))`` (rationalising the root):

    a >= 0:  lambda = x_{m+1} + log B - h      (B is non-empty: m <= k < N)
    a <  0:  lambda = x_m     - log A + h      (A is non-empty: m > k > 0)

``m = 0`` (``S1`` empty, ``P = 0``) gives ``lambda = log(S2 / 2k)``, the limit of the
closed form as ``S1 -> 0``; ``m = N`` (``S2`` empty) gives ``lambda = log(2 (N-k) / S1)``.
``sum_i F(x_i - lambda)`` falls strictly from ``N`` to ``0`` as ``lambda`` grows, so the
solution exists and is unique exactly for ``0 < k < N``.

Numerics: the forward pass runs in float32 (or wider). ``m`` is found by binary search
on the sorted entries: ``f(x_j) = sum_i F(x_i - x_j)`` grows with ``j`` and
``m = #{j : f(x_j) <= k}`` (``log2 N`` passes of ``O(N)``; ``F`` is bounded). Every
exponent above is ``<= 0``, ``h`` is evaluated relative to ``max(log|a|, log P / 2)``,
and ``z_i = x_i - lambda`` is formed as ``(x_i - anchor) - (lambda - anchor)``. The
branch's anchor is (up to ``log N``) the entry nearest to ``lambda``, so the entries
next to the threshold keep full precision: inputs spanning ``+-1e4`` (or a temperature
near 0) neither overflow nor lose the fractional entry.

Derivative (a ``custom_jvp``, so forward and reverse mode): differentiating
``sum_i F(x_i - lambda) = k`` with ``z = x - lambda``, ``F'(z) = exp(-|z|) / 2`` and
``w = softmax(-|z|)`` gives ``d lambda = sum_j w_j dx_j - dk / sum_j F'(z_j)`` and

    d ST_i = F'(z_i) (dx_i - sum_j w_j dx_j) + w_i dk,

finite for every input (no division by a vanishing ``sum_j F'(z_j)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def laplace_cdf(z: jax.Array) -> jax.Array:
    """``F(z)``: ``1 - exp(-z)/2`` for ``z >= 0``, ``exp(z)/2`` below (no overflow, exact slope 1/2 at 0)."""
    nonneg = z >= 0
    z_pos = jnp.where(nonneg, z, 0.0)
    z_neg = jnp.where(nonneg, 0.0, z)
    return jnp.where(nonneg, 1.0 - 0.5 * jnp.exp(-z_pos), 0.5 * jnp.exp(z_neg))


def _concrete(value) -> np.ndarray | None:
    """``value`` as a NumPy array, or ``None`` when it is traced (then it cannot be checked)."""
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_args(k, temperature, n: int) -> None:
    k_np = _concrete(k)
    if k_np is not None and not (np.all(k_np > 0) and np.all(k_np < n)):
        raise ValueError(f"soft_topk: k must satisfy 0 < k < n = {n} (the size of the last axis), got k={k}")
    t_np = _concrete(temperature)
    if t_np is not None and not np.all(t_np > 0):
        raise ValueError(f"soft_topk: temperature must be > 0, got temperature={temperature}")


def _count_above(xs_BN: jax.Array, k_B1: jax.Array) -> jax.Array:
    """``m = #{j : f(x_j) <= k}`` for ``xs`` sorted descending (binary search over ``j``): int ``[..., 1]``."""
    n = xs_BN.shape[-1]

    def f_at(j_B1):  # f(x_j) = sum_i F(x_i - x_j), j in 1..N
        x_j = jnp.take_along_axis(xs_BN, j_B1 - 1, axis=-1)
        return jnp.sum(laplace_cdf(xs_BN - x_j), axis=-1, keepdims=True)

    def halve(_, bounds):  # invariant: lo <= m <= hi
        lo, hi = bounds
        mid = (lo + hi + 1) // 2
        ok = f_at(jnp.maximum(mid, 1)) <= k_B1
        searching = lo < hi
        return jnp.where(searching & ok, mid, lo), jnp.where(searching & ~ok, mid - 1, hi)

    lo = jnp.zeros(k_B1.shape, jnp.int32)
    m_B1, _ = lax.fori_loop(0, n.bit_length(), halve, (lo, lo + n))
    return m_B1


def _log_scaled_root(a_B1: jax.Array, log_p_B1: jax.Array) -> jax.Array:
    """``h = log(|a| + sqrt(a^2 + P))`` from ``log P``, relative to ``scale = max(log|a|, log P / 2)``."""
    log_abs_a = jnp.log(jnp.abs(a_B1))
    scale = jnp.maximum(log_abs_a, 0.5 * log_p_B1)  # finite: a = 0 only when 0 < m = k < N, then P > 0
    a_rel = jnp.exp(log_abs_a - scale)
    return scale + jnp.log(a_rel + jnp.sqrt(a_rel * a_rel + jnp.exp(log_p_B1 - 2.0 * scale)))


def _centred(x_BN: jax.Array, k_B1: jax.Array) -> jax.Array:
    """``z = x - lambda`` from the anchored closed form."""
    n = x_BN.shape[-1]
    xs_BN = jnp.flip(jnp.sort(x_BN, axis=-1), axis=-1)
    m_B1 = _count_above(xs_BN, k_B1)
    x_m = jnp.take_along_axis(xs_BN, jnp.maximum(m_B1 - 1, 0), axis=-1)
    x_next = jnp.take_along_axis(xs_BN, jnp.minimum(m_B1, n - 1), axis=-1)
    above_BN = (x_BN >= x_m) & (m_B1 > 0)  # the m entries >= lambda (by value: ties stay together)
    log_a = jnp.log(jnp.sum(jnp.where(above_BN, jnp.exp(-jnp.abs(x_BN - x_m)), 0.0), axis=-1, keepdims=True))
    log_b = jnp.log(jnp.sum(jnp.where(above_BN, 0.0, jnp.exp(-jnp.abs(x_BN - x_next))), axis=-1, keepdims=True))
    a_B1 = k_B1 - m_B1.astype(x_BN.dtype)
    h_B1 = _log_scaled_root(a_B1, (x_next - x_m) + log_a + log_b)
    anchor_B1 = jnp.where(a_B1 >= 0, x_next, x_m)
    lam_rel_B1 = jnp.where(a_B1 >= 0, log_b - h_B1, h_B1 - log_a)  # lambda - anchor
    return (x_BN - anchor_B1) - lam_rel_B1


@jax.custom_jvp
def _soft_topk(x_BN: jax.Array, k_B1: jax.Array) -> jax.Array:
    return laplace_cdf(_centred(x_BN, k_B1))


@_soft_topk.defjvp
def _soft_topk_jvp(primals, tangents):
    """Implicit derivative of ``sum_i F(x_i - lambda) = k`` (``F' = exp(-|z|)/2``, ``w = softmax(-|z|)``):

    ``d lambda = sum_j w_j dx_j - dk / sum_j F'(z_j)``, so
    ``d ST_i = F'(z_i) (dx_i - sum_j w_j dx_j) + w_i dk``.
    """
    (x_BN, k_B1), (dx_BN, dk_B1) = primals, tangents
    z_BN = _centred(x_BN, k_B1)
    slope_BN = 0.5 * jnp.exp(-jnp.abs(z_BN))
    w_BN = jax.nn.softmax(-jnp.abs(z_BN), axis=-1)
    dx_mean_B1 = jnp.sum(w_BN * dx_BN, axis=-1, keepdims=True)
    return laplace_cdf(z_BN), slope_BN * (dx_BN - dx_mean_B1) + w_BN * dk_B1


def soft_topk(x: jax.Array, k, *, temperature=1.0) -> jax.Array:
    """Soft-TopK ``ST_k(x / temperature)`` over the last axis; sums to ``k`` along it.

    Args:
      x: scores ``[..., N]`` (finite); bf16/fp16 inputs are computed in float32.
      k: the budget, ``0 < k < N``; a scalar or an array broadcastable to ``x.shape[:-1]``
        (one budget per row). Differentiable.
      temperature: ``> 0``; ``ST`` tends to the hard top-k indicator as it goes to 0.
        Differentiable (may be traced, e.g. an annealed schedule).

    Returns:
      ``[..., N]`` in ``[0, 1]``, float32 (the input's dtype when it is wider), order
      preserving, translation invariant, ``sum(..., -1) == k``.

    Raises:
      ValueError: naming ``k`` when ``k <= 0`` or ``k >= N``, or ``temperature`` when it is
        ``<= 0`` (checked when the values are concrete; traced values are trusted).
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("soft_topk: x must have at least one axis (the entries to select from)")
    _check_args(k, temperature, x.shape[-1])
    return _scaled_soft_topk(x, k, temperature)


@jax.jit
def _scaled_soft_topk(x: jax.Array, k, temperature) -> jax.Array:
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    x_BN = x.astype(dtype) / jnp.asarray(temperature, dtype)
    k_B1 = jnp.broadcast_to(jnp.asarray(k, dtype)[..., None], x_BN.shape[:-1] + (1,))
    return _soft_topk(x_BN, k_B1)
