"""What a bounded cache holds when the answer is generated, and how it compares with the oracle.

``kept_positions`` prefills a policy's cache with the prompts (exactly what ``generate``
does before its first token) and reads back every slot's original position.
``retention_recall`` is the KVpop seed's Figure 7 metric: per layer and KV head, the
fraction of the oracle's top-k retained tokens (its long-range slots, the tokens it keeps
beyond the sinks and the recent window) that the policy also keeps under the same budget.
``eviction_map`` is Figure 6's view: per layer, how many KV heads keep each token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import decode
from kvjax.cache.slots import long_range_positions


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prefill_slots(graphdef, policy, params, policy_params, tokens_BS, lengths_B):
    model = nnx.merge(graphdef, params)
    B, S = tokens_BS.shape
    state = decode.open_state(model, policy, policy_params, B, S, lengths_B)
    _, state = decode.feed_prompt(model, decode.bind(policy, policy_params), state, tokens_BS, lengths_B)
    state = state.cache
    ev = policy.effective()
    q_B = lengths_B - 1
    every = jnp.stack([buf.pos for buf in state.layers])                                # [L, B, K, N]
    long_range = jnp.stack([long_range_positions(buf, q_B, ev) for buf in state.layers])  # [L, B, K, N]
    return every, long_range


def kept_positions(model, tokens_BS, lengths_B, policy) -> tuple[np.ndarray, np.ndarray]:
    """``(all slots int32 [L, B, K, N], long-range slots int32 [L, B, K, N])`` with ``N = s + w + m``:
    the original positions a policy's cache holds after prefilling ``tokens[b, :lengths[b]]``
    (-1 = empty slot; in the second array, also every slot that is not long range)."""
    graphdef, params = nnx.split(model)
    every, lr = _prefill_slots(graphdef, policy, params, policy.params, jnp.asarray(tokens_BS, jnp.int32),
                               jnp.asarray(lengths_B, jnp.int32))
    return np.asarray(every), np.asarray(lr)


def positions_to_mask(pos_LBKN: np.ndarray, length: int) -> np.ndarray:
    """bool ``[L, B, K, length]``: which positions appear among the slots."""
    L, B, K, _ = pos_LBKN.shape
    mask = np.zeros((L, B, K, length + 1), bool)
    idx = np.where(pos_LBKN >= 0, pos_LBKN, length)
    np.put_along_axis(mask, idx, True, axis=-1)
    return mask[..., :length]


def retention_recall(policy_all_LBKN: np.ndarray, oracle_lr_LBKN: np.ndarray, length: int) -> np.ndarray:
    """float ``[L, B, K]``: |oracle top-k kept ∩ policy kept| / |oracle top-k kept| (NaN when the
    oracle keeps no long-range token, e.g. a prompt shorter than sinks + window)."""
    kept = positions_to_mask(policy_all_LBKN, length)
    oracle = positions_to_mask(oracle_lr_LBKN, length)
    hits = (kept & oracle).sum(-1).astype(np.float64)
    total = oracle.sum(-1).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, hits / np.maximum(total, 1), np.nan)


def eviction_map(policy_all_LBKN: np.ndarray, row: int, length: int) -> np.ndarray:
    """int ``[L, length]``: for one batch row, how many KV heads of each layer keep each token."""
    return positions_to_mask(policy_all_LBKN[:, row : row + 1], length)[:, 0].sum(1).astype(np.int32)
