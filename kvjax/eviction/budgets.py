"""Budget allocation: how many long-range slots each layer and KV head may fill, at the same
total memory as the uniform split (``topk`` per head). Rankers choose *which* tokens; these
rules only choose *how many* per head, so every ranker composes with every rule
(``EvictionConfig.budgets``).

- ``uniform``: every head ``topk``.
- ``pyramid`` (PyramidKV, Cai et al. 2024, arXiv:2406.02069, eq. 6-7; kvpress's
  ``PyramidKVPress``): layer budgets fall linearly with depth around the mean ``m = topk``,

      b_0 = 2m - m/beta,  b_{L-1} = m/beta,  b_l = b_0 - l (b_0 - b_{L-1}) / (L - 1),

  the paper's default ``beta = 20``; if ``b_0`` exceeds the cap ``k_max``, ``b_0 = k_max`` and
  ``b_{L-1} = 2m - k_max``. Rounded to integers summing to exactly ``L m`` (largest remainders).
- ``adakv`` (Ada-KV, Feng et al. 2024, arXiv:2407.11550, Algorithm 1; kvpress's ``AdaKVPress``):
  per layer, the ``K m`` long-range candidates of highest score over *all* heads of the
  layer are kept, so a head whose attention is concentrated on few tokens gives its slots to
  heads whose attention is spread; the safeguard (``alpha``, default 0.2, as in kvpress) first
  guarantees each head its own ``floor(alpha m)`` best candidates. Scores must be comparable
  across heads (attention mass: SnapKV, H2O, TOVA; KVpop's predicted log future attention).
- ``shares``: a fixed split given per head as multiples of ``topk`` (a diagnostic: "this head
  keeps its whole context", "these heads split the same total otherwise").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.eviction.fenwick import token_ranks

RULES = ("uniform", "pyramid", "adakv")


def apportion(x_L, total: int) -> np.ndarray:
    """Integers ``int [L]`` with ``floor(x) <= out <= ceil(x)`` summing to ``total`` (largest
    remainders; ties to the earlier entry). ``sum(x)`` must equal ``total``."""
    x = np.asarray(x_L, np.float64)
    base = np.floor(x + 1e-9).astype(np.int64)
    short = int(total) - int(base.sum())
    if short < 0 or short > len(x):
        raise ValueError(f"apportion: the entries sum to {x.sum():.3f}, not the total {total}")
    order = np.argsort(-(x - base), kind="stable")
    base[order[:short]] += 1
    return base


def pyramid_budgets(num_layers: int, mean: int, cap: int, beta: float = 20.0) -> np.ndarray:
    """PyramidKV's long-range budget per layer, ``int [L]``: linear in depth, mean ``mean``,
    none above ``cap`` (see the module docstring); the sum is exactly ``num_layers * mean``."""
    if beta < 1:
        raise ValueError(f"pyramid_beta must be >= 1, got {beta}")
    if cap < mean:
        raise ValueError(f"pyramid budgets: the cap k_max={cap} is below the mean budget topk={mean}")
    if num_layers == 1 or mean == 0:
        return np.full(num_layers, mean, np.int64)
    low = mean / beta
    high = 2 * mean - low
    if high > cap:
        high, low = float(cap), 2.0 * mean - cap
    x = high - np.arange(num_layers) * (high - low) / (num_layers - 1)
    return apportion(x, num_layers * mean)


def shares_budgets(shares_LK, mean: int, cap: int, shape: tuple[int, int]) -> np.ndarray:
    """``int [L, K]``: head ``(l, k)`` gets ``floor(shares[l][k] * mean)`` long-range slots, at
    most ``cap`` (``budgets="shares"``); ``shape`` is the model's ``(layers, kv_heads)``."""
    s = np.asarray(shares_LK, np.float64)
    if s.shape != tuple(shape):
        raise ValueError(f"head_shares has shape {s.shape}, the model needs [layers, kv_heads] = {tuple(shape)}")
    return np.minimum(np.floor(s * mean + 1e-9), cap).astype(np.int64)


def adakv_select(prio_BKN, candidate_BKN, n_top_B, alpha: float) -> jax.Array:
    """``bool [B, K, N]``: Ada-KV's kept long-range candidates of one layer: each head's best
    ``floor(alpha n_top)`` candidates, then the best of all heads' candidates up to ``K n_top``
    in all (fewer if fewer are candidates). ``n_top [B]``: the uniform per-head count."""
    B, K, N = prio_BKN.shape
    prio = jnp.where(candidate_BKN, prio_BKN.astype(jnp.float32), jnp.nan)
    own = token_ranks(prio)                                              # per head, NaN last
    n_top = jnp.asarray(n_top_B, jnp.int32)
    n_safe = jnp.floor(alpha * n_top).astype(jnp.int32)[:, None, None]
    boosted = jnp.where(candidate_BKN & (own < n_safe), jnp.inf, prio)
    joint = token_ranks(boosted.reshape(B, K * N)).reshape(B, K, N)
    return candidate_BKN & (joint < (K * n_top)[:, None, None])


def adakv_budgets(kept_BKN, n_top_B, cap: int) -> jax.Array:
    """``int32 [B, K]``: each head's budget after :func:`adakv_select`: its kept count plus an
    even share of the layer's unused total (``K n_top`` minus the kept), at most ``cap``."""
    K = kept_BKN.shape[1]
    count = jnp.sum(kept_BKN, axis=-1).astype(jnp.int32)
    spare = jnp.maximum(K * jnp.asarray(n_top_B, jnp.int32) - jnp.sum(count, axis=-1), 0)[:, None]
    share = spare // K + (jnp.arange(K)[None, :] < spare % K)
    return jnp.minimum(count + share, cap).astype(jnp.int32)
