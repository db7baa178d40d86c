"""Keep rule and its running top-k cutoffs against brute-force definitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvjax.eviction.fenwick import (
    cutoffs_from_ranks,
    fenwick_cutoffs,
    fenwick_cutoffs_sequential,
    naive_cutoffs,
    token_ranks,
)
from kvjax.eviction.keep_rule import compact_keep, keep_mask, keep_mask_from_compact, static_priority

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Every distinct length compiles once; drawing lengths from a fixed set keeps the file fast.
SMALL = (1, 2, 3, 5, 8, 13, 31, 32, 33, 48)
LARGE = (129, 1000, 2048)


def brute_force_mask(priority_S, sinks, window, topk):
    """The keep rule read literally: at every q sort E(q) by (priority, t) descending."""
    S = len(priority_S)
    mask = np.zeros((S, S), bool)
    for q in range(S):
        eligible = sorted(range(sinks, max(q - window + 1, sinks)), key=lambda t: (priority_S[t], t), reverse=True)
        for t in eligible[:topk]:
            mask[q, t] = True
        mask[q, : min(sinks, q + 1)] = True
        mask[q, max(q - window + 1, 0) : q + 1] = True
    return mask


@st.composite
def budgets(draw, S, count=4):
    """``count`` budgets ``(sinks, window, topk)``, incl. k = 0, k >= |E| and s, w >= S."""
    small = st.integers(0, 4)
    return [
        (
            draw(st.one_of(small, st.integers(0, S + 2))),
            draw(st.one_of(st.integers(1, 4), st.integers(1, S + 2))),
            draw(st.one_of(small, st.integers(0, S + 3))),
        )
        for _ in range(count)
    ]


@st.composite
def cases(draw, sizes=SMALL, large=LARGE):
    """``(priority [S], budgets)``; tiny integer ranges give many ties."""
    S = draw(st.sampled_from(sizes) if draw(st.integers(0, 5)) else st.sampled_from(large))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        priority = rng.integers(0, draw(st.integers(1, 4)), S).astype(np.float32)
    else:
        priority = rng.normal(size=S).astype(np.float32)
    return priority, draw(budgets(S))


@SETTINGS
@given(cases())
@example((np.zeros(1, np.float32), [(0, 1, 0), (0, 1, 1), (1, 1, 1)]))
@example((np.zeros(13, np.float32), [(0, 1, 3), (2, 3, 100), (13, 1, 1), (0, 14, 2)]))
def test_cutoffs_match_naive(case):
    priority, budget_list = case
    for sinks, window, topk in budget_list:
        expected = naive_cutoffs(priority, sinks=sinks, window=window, topk=topk)
        np.testing.assert_array_equal(fenwick_cutoffs(priority, sinks=sinks, window=window, topk=topk), expected)
        if len(priority) in SMALL:
            sequential = fenwick_cutoffs_sequential(priority, sinks=sinks, window=window, topk=topk)
            np.testing.assert_array_equal(sequential, expected)


@settings(SETTINGS, max_examples=12)
@given(cases(large=(100,)))
def test_keep_mask_matches_brute_force(case):
    priority, budget_list = case
    for sinks, window, topk in budget_list:
        got = keep_mask(priority, sinks=sinks, window=window, topk=topk)
        np.testing.assert_array_equal(got, brute_force_mask(priority, sinks, window, topk))


@settings(SETTINGS, max_examples=12)
@given(st.sampled_from([(1, 1, 1), (13, 4, 16), (33, 8, 5), (48, 16, 16), (100, 7, 32)]), st.data())
def test_compact_form_matches_dense(shape, data):
    """Per (S, block_q, block_k): dense form from (rank, cutoff) equals the literal rule,
    and block summaries equal the block-reduced dense mask (two rows at once)."""
    S, block_q, block_k = shape
    seed = data.draw(st.integers(0, 2**32 - 1))
    priority = np.random.default_rng(seed).integers(0, 3, (2, S)).astype(np.float32)
    for sinks, window, topk in data.draw(budgets(S, count=2)):
        compact = compact_keep(priority, sinks=sinks, window=window, topk=topk, block_q=block_q, block_k=block_k)
        dense = np.asarray(keep_mask_from_compact(compact.rank, compact.cutoff, sinks, window))
        for row in range(2):
            np.testing.assert_array_equal(dense[row], brute_force_mask(priority[row], sinks, window, topk))
        nq, nk = -(-S // block_q), -(-S // block_k)
        padded = np.zeros((2, nq * block_q, nk * block_k), bool)
        padded[:, :S, :S] = dense
        reduced = padded.reshape(2, nq, block_q, nk, block_k).any(axis=(2, 4))
        np.testing.assert_array_equal(compact.block_any_kept, reduced)


def test_leading_axes_are_rows():
    rng = np.random.default_rng(0)
    priority = rng.integers(0, 3, (2, 3, 50)).astype(np.float32)
    got = fenwick_cutoffs(priority, sinks=2, window=4, topk=5)
    assert got.shape == (2, 3, 50)
    for b in range(2):
        for h in range(3):
            np.testing.assert_array_equal(got[b, h], naive_cutoffs(priority[b, h], sinks=2, window=4, topk=5))
    ranks = token_ranks(priority)
    np.testing.assert_array_equal(cutoffs_from_ranks(ranks, sinks=2, window=4, topk=5), got)


def test_token_ranks_break_ties_towards_recent():
    np.testing.assert_array_equal(token_ranks(np.array([1.0, 3.0, 1.0, 3.0, 2.0])), [4, 1, 3, 0, 2])
    # -0.0 ties with 0.0; infinities order as numbers; NaN ranks last.
    special = np.array([0.0, -0.0, 1.0, np.nan, -np.inf, 0.0, np.inf, -2.5, np.nan], np.float32)
    np.testing.assert_array_equal(token_ranks(special), [4, 3, 1, 8, 6, 2, 0, 5, 7])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8, np.uint32, np.float16])
def test_token_ranks_integer_and_narrow_dtypes(dtype):
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else np.finfo(dtype)
    values = np.array([3, info.max, 3, info.min, 0, 7], dtype)
    order = sorted(range(6), key=lambda t: (-float(values[t]), -t))
    np.testing.assert_array_equal(np.argsort(token_ranks(values)), order)


def test_static_priority_orders_like_decayed_scores():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(2, 30)).astype(np.float32)
    decay = np.array([0.0, 0.3], np.float32)
    priority = np.asarray(static_priority(scores, decay))
    np.testing.assert_allclose(priority, scores + decay[:, None] * np.arange(30), rtol=1e-6)
    q = 29
    decayed = scores - decay[:, None] * (q - np.arange(30))
    np.testing.assert_array_equal(np.argsort(-priority, axis=-1), np.argsort(-decayed, axis=-1))
    # the scorers' form: [B, K, S] scores, one decay per head, each row's own positions
    r = rng.normal(size=(2, 2, 5)).astype(np.float32)
    r[1, 0, 2] = -np.inf
    t = np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    got = np.asarray(static_priority(r, decay, t[:, None, :]))
    np.testing.assert_allclose(got, r + decay[None, :, None] * t[:, None, :], rtol=1e-6)
    assert got[1, 0, 2] == -np.inf


def test_seed_fenwick_walkthrough():
    """Seed, "Efficient Online Pruning": tokens 0, 1, 2 enter with ranks 3, 1, 4
    (1-based) and k = 2; the cutoff is rank 3 after tokens 0, 1 and stays 3 after
    token 2. Here 0-based (2, 0, 3), w = 1 so token t enters at q = t + 1."""
    priority = np.array([3.0, 5.0, 2.0, 4.0, 1.0])  # ranks 2, 0, 3, 1, 4
    np.testing.assert_array_equal(token_ranks(priority), [2, 0, 3, 1, 4])
    cutoffs = fenwick_cutoffs(priority, sinks=0, window=1, topk=2)
    np.testing.assert_array_equal(cutoffs, [5, 5, 2, 2, 1])  # S = 5 while fewer than k are eligible


def test_seed_keep_mask_walkthrough():
    """Seed, "Delayed Memory Scoring": ranks (1-based) 2, 6, 3, 1, 5, 4 for tokens
    0..5; at q = 3 token 1 becomes eligible (w = 2) and the row keeps tokens 0, 2, 3:
    the best eligible token plus the window (k = 1). The seed's stated cutoff (rank 3,
    a window token) is not an eligible rank; under the keep rule of docs/design.md it is rank 1 (0-based)."""
    priority = np.array([5.0, 1.0, 4.0, 6.0, 2.0, 3.0])
    np.testing.assert_array_equal(token_ranks(priority), [1, 5, 2, 0, 4, 3])
    assert int(fenwick_cutoffs(priority, sinks=0, window=2, topk=1)[3]) == 1
    mask = np.asarray(keep_mask(priority, sinks=0, window=2, topk=1))
    np.testing.assert_array_equal(np.flatnonzero(mask[3]), [0, 2, 3])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sinks=0, window=0, topk=1), "window must be >= 1, got 0"),
        (dict(sinks=-1, window=1, topk=1), "sinks must be >= 0, got -1"),
        (dict(sinks=0, window=1, topk=-2), "topk must be >= 0, got -2"),
        (dict(sinks=0, window=1.5, topk=1), "window must be an int, got 1.5"),
        (dict(sinks=True, window=1, topk=1), "sinks must be an int, got True"),
    ],
)
def test_budget_errors_name_the_field(kwargs, message):
    priority = np.zeros(8, np.float32)
    for fn in (keep_mask, fenwick_cutoffs, fenwick_cutoffs_sequential, compact_keep):
        with pytest.raises(ValueError, match=message):
            fn(priority, **kwargs)


def test_shape_and_block_errors():
    budget = dict(sinks=1, window=2, topk=3)
    with pytest.raises(ValueError, match=r"priority must be 1-D \[S\] for keep_mask, got shape \(2, 4\)"):
        keep_mask(np.zeros((2, 4)), **budget)
    with pytest.raises(ValueError, match=r"priority must have shape \[..., S\] with S >= 1, got shape \(\)"):
        fenwick_cutoffs(np.float32(1.0), **budget)
    with pytest.raises(ValueError, match=r"S >= 1, got shape \(0,\)"):
        keep_mask(np.zeros(0), **budget)
    with pytest.raises(ValueError, match="priority must be real-valued, got dtype complex64"):
        token_ranks(np.zeros(4, np.complex64))
    with pytest.raises(ValueError, match="block_q must be >= 1, got 0"):
        compact_keep(np.zeros(4), **budget, block_q=0)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        keep_mask_from_compact(np.zeros(4, np.int32), np.zeros(4, np.int32), 0, 0)
    with pytest.raises(ValueError, match="rank and cutoff must have the same shape"):
        keep_mask_from_compact(np.zeros(4, np.int32), np.zeros(5, np.int32), 0, 1)
