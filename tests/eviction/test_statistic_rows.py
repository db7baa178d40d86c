"""Attention statistics read only the query rows they need (SnapKV: the observation window,
TOVA: the last query), and H2O reads every row a block at a time: the scores equal those
from every row's probabilities at once."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.eviction.attention import causal_probs, statistic_probs, statistic_scores
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.policies import make_policy


@pytest.mark.parametrize("name", ["snapkv", "tova", "pyramidkv", "adakv", "h2o"])
def test_row_scores_equal_full_scores(name):
    rs = np.random.RandomState(0)
    B, S, K, G, D = 3, 50, 2, 2, 8
    q = jnp.asarray(rs.randn(B, S, K * G, D) * 2, jnp.float32)
    k = jnp.asarray(rs.randn(B, S, K, D), jnp.float32)
    lengths = jnp.asarray([50, 31, 5])                       # row 2: shorter than the observation window
    pol = make_policy(name, EvictionConfig(sinks=2, window=4, topk=8, obs_window=8, pool=3))
    full = pol.prefill_scores(*statistic_probs(q, k, lengths, None)[:1], lengths, jnp.broadcast_to(jnp.arange(S), (B, S)))
    probs, qpos = statistic_probs(q, k, lengths, pol.score_rows)
    got = pol.prefill_scores(probs, lengths, qpos)
    for b, n in enumerate([50, 31, 5]):
        np.testing.assert_allclose(np.asarray(got[b, :, :n]), np.asarray(full[b, :, :n]), atol=1e-6, err_msg=str(b))
    assert (pol.score_rows is None) == (name == "h2o")
    # every row in blocks of 16 (50 rows: the last block is padding past the prompt)
    blocked = statistic_scores(q, k, lengths, None, pol.prefill_scores, block=16)
    for b, n in enumerate([50, 31, 5]):
        np.testing.assert_allclose(np.asarray(blocked[b, :, :n]), np.asarray(full[b, :, :n]), atol=1e-6,
                                   err_msg=f"blocks, row {b}")
    if pol.columnwise:      # query blocks that skip the keys past the block (the last block: 2 rows)
        tri = statistic_scores(q, k, lengths, None, pol.prefill_scores, block=16, columnwise=True)
        for b, n in enumerate([50, 31, 5]):
            np.testing.assert_allclose(np.asarray(tri[b, :, :n]), np.asarray(full[b, :, :n]), atol=1e-6,
                                       err_msg=f"columnwise blocks, row {b}")
    assert pol.columnwise == (name == "h2o")      # SnapKV's pooling reads neighbouring columns


def test_selected_rows_are_rows_of_the_causal_probabilities():
    rs = np.random.RandomState(1)
    q = jnp.asarray(rs.randn(2, 20, 4, 8), jnp.float32)
    k = jnp.asarray(rs.randn(2, 20, 2, 8), jnp.float32)
    probs, qpos = statistic_probs(q, k, jnp.asarray([20, 9]), 5)
    full = np.asarray(causal_probs(q, k))
    np.testing.assert_array_equal(np.asarray(qpos), [[15, 16, 17, 18, 19], [4, 5, 6, 7, 8]])
    for b in range(2):
        np.testing.assert_allclose(np.asarray(probs[b]), full[b][:, :, np.asarray(qpos[b])], atol=1e-6)
