"""Future-attention target: transposed chunked pass = dense reference; the seed's example."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.targets import _finish, dense_target, future_attention_target, peak_future_attention


@pytest.mark.parametrize("group", [1, *(pytest.param(g, marks=pytest.mark.integration) for g in (2, 4))])   # 2, 4: make test
@pytest.mark.parametrize("S, window, block", [(50, 4, 16), (97, 1, 32), (64, 16, 64), (33, 40, 8)])
@pytest.mark.parametrize("aggregate", ["max", "mean"])
def test_transposed_equals_dense(group, S, window, block, aggregate):
    rs = np.random.RandomState(S * group + window)
    K, D = 2, 16
    q = jnp.asarray(rs.randn(2, S, K * group, D).astype(np.float32))
    k = jnp.asarray(rs.randn(2, S, K, D).astype(np.float32))
    got = future_attention_target(q, k, window=window, aggregate=aggregate, block=block)
    want = dense_target(q, k, window=window, aggregate=aggregate)
    assert got.shape == (2, K, S)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    assert (~finite).sum() == 2 * K * min(S, window)            # t + w >= S carries no target
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("S, window, block", [(50, 4, 16), (97, 1, 32), (33, 40, 8)])
def test_peak_future_attention_equals_materialised_max(S, window, block):
    """r_peak(h, t) = max over the group and over queries d >= t + w of log p(d -> t)."""
    rs = np.random.RandomState(S + window)
    q = jnp.asarray(rs.randn(2, S, 4, 8).astype(np.float32) * 2)
    k = jnp.asarray(rs.randn(2, S, 2, 8).astype(np.float32))
    got = np.asarray(peak_future_attention(q, k, window=window, block=block))
    want = np.full((2, 2, S), -np.inf, np.float32)
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
    for b in range(2):
        for h in range(4):
            lg = qn[b, :, h] @ kn[b, :, h // 2].T / np.sqrt(8)                 # [S(query), S(key)]
            lg = np.where(np.tril(np.ones((S, S), bool)), lg, -np.inf)
            lp = lg - np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1, keepdims=True)) - lg.max(1, keepdims=True)
            for t in range(S - window):
                want[b, h // 2, t] = max(want[b, h // 2, t], lp[t + window:, t].max())
    finite = np.isfinite(want)
    assert finite.sum() == 2 * 2 * max(S - window, 0)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    assert (got[finite] <= 1e-6).all()                                              # log of a probability


def test_sparse_lse_is_reused():
    rs = np.random.RandomState(0)
    q = jnp.asarray(rs.randn(1, 40, 4, 8).astype(np.float32))
    k = jnp.asarray(rs.randn(1, 40, 2, 8).astype(np.float32))
    lse = jnp.asarray(rs.randn(1, 40, 4).astype(np.float32))
    np.testing.assert_allclose(np.asarray(future_attention_target(q, k, window=3, lse=lse))[..., :37],
                               np.asarray(dense_target(q, k, window=3, lse=lse))[..., :37], rtol=1e-5, atol=1e-5)


def test_seed_worked_example():
    """N_t = max(1, 6 - (2 + 2)) = 2; groups 0.30 + 0.20 and 0.10 + 0.10 -> log(0.25) = -1.386."""
    S, w, t = 6, 2, 2
    mass = np.full((1, 1, 2, S), 1e-30, np.float32)
    mass[0, 0, :, t] = [0.30 + 0.20, 0.10 + 0.10]
    out = np.asarray(_finish(jnp.log(jnp.asarray(mass)), S, w, "max", 1e-12))
    assert out[0, 0, t] == pytest.approx(np.log(0.25), abs=1e-6) and round(float(out[0, 0, t]), 3) == -1.386
    mean = np.asarray(_finish(jnp.log(jnp.asarray(mass)), S, w, "mean", 1e-12))
    assert mean[0, 0, t] == pytest.approx(np.log((0.25 + 0.10) / 2), abs=1e-6)


def test_errors():
    q, k = jnp.zeros((1, 8, 3, 4)), jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        future_attention_target(q, k, window=2)
    with pytest.raises(ValueError, match="aggregate must be 'max' or 'mean'"):
        future_attention_target(jnp.zeros((1, 8, 2, 4)), k, window=2, aggregate="sum")


@pytest.mark.parametrize("fn", ["mean", "peak"])
def test_right_padded_rows_with_lengths_equal_each_row_alone(fn):
    """A batch padded on the right with ``lengths_B`` gives each row's unpadded target
    (padding queries read nothing; ``N_t`` counts the row's own queries)."""
    rs = np.random.RandomState(3)
    S, window, lengths = 40, 4, [40, 23]
    q = jnp.asarray(rs.randn(2, S, 4, 8).astype(np.float32))
    k = jnp.asarray(rs.randn(2, S, 2, 8).astype(np.float32))
    f = (lambda *a, **kw: future_attention_target(*a, **kw)) if fn == "mean" else peak_future_attention
    got = np.asarray(f(q, k, window=window, block=16, lengths_B=jnp.asarray(lengths)))
    for b, n in enumerate(lengths):
        alone = np.asarray(f(q[b:b + 1, :n], k[b:b + 1, :n], window=window, block=16))[0]
        np.testing.assert_allclose(got[b, :, :n], alone, rtol=1e-5, atol=1e-6)
        assert np.isneginf(got[b, :, n - window:]).all()


@pytest.mark.parametrize("reduce, window, segments", [
    ("sum", 12, 40), ("max", 1, 3),     # test-fast: both reduces, run counts, windows; a skipped first run (12 > 8)
    *(pytest.param(*case, marks=pytest.mark.integration)  # the other six: make test
      for case in [("sum", 1, 3), ("sum", 1, 40), ("sum", 12, 3), ("max", 1, 40), ("max", 12, 3), ("max", 12, 40)]),
])
def test_future_log_mass_in_runs_equals_brute_force(segments, window, reduce):
    """13 query blocks scanned in 3 runs (of 5, 5 and 3 blocks) or 13, each run reading only the keys its queries reach,
    give every key's log mass (or log peak) over queries d >= t + w of each row's length."""
    from pallas_kernels.reference import future_log_mass

    B, S, K, G, D = 2, 100, 2, 2, 8
    rs = np.random.RandomState(segments + window)
    q = rs.randn(B, S, K * G, D).astype(np.float32)
    k = rs.randn(B, S, K, D).astype(np.float32)
    lengths = np.asarray([100, 61], np.int32)
    got = np.asarray(future_log_mass(jnp.asarray(q), jnp.asarray(k), window=window, block=8, reduce=reduce,
                                     lengths_B=jnp.asarray(lengths), segments=segments))
    want = np.full((B, K, G, S), -np.inf)
    for b in range(B):
        for h in range(K * G):
            lg = q[b, :, h].astype(np.float64) @ k[b, :, h // G].T.astype(np.float64) / np.sqrt(D)
            lg = np.where(np.tril(np.ones((S, S), bool)), lg, -np.inf)
            lp = lg - np.logaddexp.reduce(lg, axis=1, keepdims=True)               # causal log-probabilities
            d, t = np.arange(S)[:, None], np.arange(S)[None, :]
            lp = np.where((d >= t + window) & (d < lengths[b]), lp, -np.inf)         # the queries that count
            want[b, h // G, h % G] = np.logaddexp.reduce(lp, axis=0) if reduce == "sum" else lp.max(axis=0)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5)
