"""Hindsight oracles: the mean target, the peak, and their union by percentile rank."""

import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.evaluation.oracle import oracle_priorities
from train_helpers import TINY_MODEL


def _pct(row):
    """Percentile rank among the finite entries (the -1e6 + t fillers rank below)."""
    finite = row > -1e5
    out = np.full(row.shape, -np.inf)
    order = np.argsort(row[finite], kind="stable")
    ranks = np.empty(finite.sum())
    ranks[order] = np.arange(finite.sum())
    out[finite] = ranks / len(row)
    return out


def test_union_takes_the_better_percentile_of_peak_and_mean():
    model = kvjax.Decoder(kvjax.ModelConfig.from_hf_config(TINY_MODEL), rngs=nnx.Rngs(0), init_std=0.2)
    tokens = np.random.RandomState(1).randint(3, 200, (2, 30))
    mean, peak, union = (np.asarray(oracle_priorities(model, tokens, 4, kind)) for kind in ("mean", "peak", "union"))
    assert mean.shape == peak.shape == union.shape == (2, 2, 2, 30)
    assert (peak[..., :26] <= 1e-6).all() and (peak[..., :26] >= mean[..., :26] - 1e-5).all()  # max >= mean
    for l, b, k in np.ndindex(2, 2, 2):
        want = np.maximum(_pct(peak[l, b, k]), _pct(mean[l, b, k]))
        np.testing.assert_allclose(union[l, b, k, :26], want[:26], atol=1e-6)
        assert (union[l, b, k, 26:] < -1e5).all()            # no future query: ranked by recency below all
        assert np.all(np.diff(union[l, b, k, 26:]) > 0)
    with pytest.raises(ValueError, match="oracle kind must be one of"):
        oracle_priorities(model, tokens, 4, "median")
