"""The dense cache's decode attention reads only the blocks up to the furthest query, and equals
the causal softmax over the whole allocated cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import grouped_attention, prefix_attention


@pytest.mark.parametrize("T,block,S", [(40, 16, 1), (48, 16, 3), (40, 64, 1), (37, 8, 2)])
def test_prefix_attention_is_causal_attention_over_the_cache(T, block, S):
    """Rows at different positions (one in the first block, one in the ragged last), several
    queries per row, a block larger than the cache: the same outputs and log-sum-exps."""
    B, K, G, D = 2, 2, 3, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, S, K * G, D)) * 2
    k = jax.random.normal(ks[1], (B, K, T, D)) * 2
    v = jax.random.normal(ks[2], (B, K, T, D))
    last = jnp.array([min(5, T - 1), T - 1])
    q_pos = last[:, None] - (S - 1) + jnp.arange(S)[None, :]
    causal = (jnp.arange(T)[None, None, :] <= q_pos[:, :, None])[:, None, None]
    want, want_lse, _ = grouped_attention(q, k, v, allowed=causal, kv_layout="BKTD")
    out, lse = jax.jit(prefix_attention, static_argnames="block")(q, k, v, q_pos, block=block)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-6, atol=2e-6)


def test_prefix_attention_never_reads_past_the_furthest_query():
    """Slots past every query's position may hold anything (NaN here): they are not read."""
    B, K, T, D = 1, 1, 64, 4
    q = jnp.ones((B, 1, 2, D))
    k = jnp.ones((B, K, T, D)).at[:, :, 32:].set(jnp.nan)
    v = jnp.arange(T, dtype=jnp.float32)[None, None, :, None] * jnp.ones((B, K, T, D))
    out, _ = prefix_attention(q, k, v.at[:, :, 32:].set(jnp.nan), jnp.array([[20]]), block=16)
    np.testing.assert_allclose(out, np.full((B, 1, 2, D), 10.0), rtol=1e-6)     # the mean of positions 0..20
