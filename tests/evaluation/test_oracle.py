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


def test_the_mean_oracle_is_each_layers_future_mass_under_plain_causal_attention():
    """The oracle's forward attends in query blocks (``prefill=True``); its priorities equal the
    future-attention target of every layer's queries and keys from a plain causal forward with
    the full ``S x S`` attention (ragged rows: the second counts 29 queries)."""
    from kvjax.models.attention import dense_attention
    from kvjax.targets import future_attention_target

    model = kvjax.Decoder(kvjax.ModelConfig.from_hf_config(TINY_MODEL), rngs=nnx.Rngs(0), init_std=0.2)
    tokens = np.random.RandomState(2).randint(3, 200, (2, 300))
    lengths = np.asarray([300, 229], np.int32)
    got = np.asarray(oracle_priorities(model, tokens, 4, "mean", lengths_B=lengths))

    def capture(layer, q, k, v, positions, acc):
        out, _ = dense_attention(q, k, v, positions, positions)               # every query over every key
        return out, acc + ((q, k),)

    _, qk = model(tokens, None, capture, ())
    for layer, (q, k) in enumerate(qk):
        want = np.asarray(future_attention_target(q, k, window=4, lengths_B=lengths))
        for b, n in enumerate(lengths):
            real = np.isfinite(want[b, :, : n - 4])
            np.testing.assert_allclose(got[layer, b][:, : n - 4][real], want[b, :, : n - 4][real], atol=2e-5,
                                       err_msg=f"layer {layer}, row {b}")


@pytest.mark.parametrize("kind", [pytest.param("mean", marks=pytest.mark.integration),   # union (both reduces):
                                  pytest.param("peak", marks=pytest.mark.integration),   # test-fast; all three:
                                  "union"])                                              # make test
def test_the_oracle_from_a_shared_prefill_equals_the_oracle_of_the_whole_rows(kind):
    """``prefill_oracle_priorities`` (the context's queries from the shared prefill, the tail run
    again) equals ``oracle_priorities`` on context + tail, at every slot: ragged rows, and a
    padded tail that runs past the cache's last slot (row 0: 50 + 32 > 72)."""
    from kvjax.eviction.shared_prefill import prefill_context
    from kvjax.evaluation.oracle import prefill_oracle_priorities

    model = kvjax.Decoder(kvjax.ModelConfig.from_hf_config(TINY_MODEL), rngs=nnx.Rngs(0), init_std=0.2)
    rng = np.random.RandomState(3)
    ctx = [rng.randint(3, 200, n).tolist() for n in (50, 37)]
    tails = [rng.randint(3, 200, n).tolist() for n in (20, 9)]
    T = 72
    pre = prefill_context(model, ctx, cache_len=T, keep_queries=True)
    got = np.asarray(prefill_oracle_priorities(model, pre, tails, 4, kind))
    whole = np.zeros((2, T), np.int32)
    for b, (c, t) in enumerate(zip(ctx, tails)):
        whole[b, : len(c) + len(t)] = c + t
    want = np.asarray(oracle_priorities(model, whole, 4, kind, lengths_B=np.asarray([70, 46], np.int32)))
    assert got.shape == want.shape == (2, 2, 2, T)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.argsort(got[..., :70], kind="stable")[:, 0, :, -20:],
                                  np.argsort(want[..., :70], kind="stable")[:, 0, :, -20:])
    with pytest.raises(ValueError, match="keep_queries=True"):
        prefill_oracle_priorities(model, prefill_context(model, ctx, cache_len=T, keep_queries=False), tails, 4)
    with pytest.raises(ValueError, match="every row needs 1 to T - n_b tokens"):
        prefill_oracle_priorities(model, pre, [tails[0] * 2, tails[1]], 4, kind)
