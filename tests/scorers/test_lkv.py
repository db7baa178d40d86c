"""LKV operators: closed-form Soft-TopK, LKV-H ratios/budgets, LKV-T token scorer and Gumbel schedule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from kvjax.lkv import (LKVHeads, LKVParam, LKVTokenScorer, gumbel_temperature, gumbel_topk_mask, integer_budgets,
                       noisy_scores, soft_topk)

# each new vector size costs one compilation: keep the example counts modest
VECTORS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BUDGETS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_soft_topk(x, k):
    """Float64 bisection on ``sum_i F(x_i - lambda) = k`` (independent of the closed form), for the
    float32 ``x`` and ``k`` that ``soft_topk`` sees."""
    x, k = np.asarray(x, np.float64), float(np.float32(k))
    lo, hi = x.min() - 60.0, x.max() + 60.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if laplace_np(x - mid).sum() > k else (lo, mid)
    return laplace_np(x - 0.5 * (lo + hi))


def laplace_np(z):
    return np.where(z >= 0, 1.0 - 0.5 * np.exp(-np.maximum(z, 0.0)), 0.5 * np.exp(np.minimum(z, 0.0)))


def assert_sums_to(out, k, atol=1e-5):
    total = np.sum(np.asarray(out, np.float64), axis=-1)
    np.testing.assert_allclose(total, np.broadcast_to(np.float32(k), total.shape), rtol=1e-6, atol=atol)


# ---------------------------------------------------------------- Soft-TopK

def test_hand_computed_examples():
    # x = (2, 0, -1), k = 1: m = 1, a = k - m = 0, so lambda = log(sqrt(S1 S2) / S1) = (log S2 - log S1) / 2
    # with S1 = e^-2, S2 = e^0 + e^-1: lambda = 1 + log(1 + e^-1) / 2 = 1.15667, inside [x_2, x_1] = [0, 2]
    lam = 1.0 + 0.5 * math.log(1.0 + math.exp(-1.0))
    want = [1.0 - 0.5 * math.exp(-(2.0 - lam)), 0.5 * math.exp(-lam), 0.5 * math.exp(-1.0 - lam)]
    np.testing.assert_allclose(soft_topk(jnp.array([2.0, 0.0, -1.0]), 1.0), want, rtol=1e-6)
    np.testing.assert_allclose(want, [0.7848708, 0.1572721, 0.0578572], atol=1e-7)
    # m = 0 (S1 empty): lambda = log(S2 / 2k) = log 2 for x = (0, 0), k = 1/2, so F(-log 2) = 1/4 each
    np.testing.assert_allclose(soft_topk(jnp.zeros(2), 0.5), [0.25, 0.25], rtol=1e-6)
    # m = N (S2 empty): lambda = log(2 (N - k) / S1) = -log 2 for k = 3/2, so F(log 2) = 3/4 each
    np.testing.assert_allclose(soft_topk(jnp.zeros(2), 1.5), [0.75, 0.75], rtol=1e-6)
    # temperature divides x: ST_k(x; tau) = ST_k(x / tau)
    np.testing.assert_allclose(soft_topk(jnp.array([4.0, 0.0, -2.0]), 1.0, temperature=2.0), want, rtol=1e-6)


def test_matches_reference_sums_to_k_order_and_translation():
    x = jnp.asarray(np.random.default_rng(0).normal(size=50) * 3, jnp.float32)
    for k in (0.3, 1.0, 7.5, 25.0, 49.7):
        out = soft_topk(x, k)
        np.testing.assert_allclose(out, reference_soft_topk(x, k), atol=1e-6)
        assert_sums_to(out, k)
        order = np.argsort(-np.asarray(x))
        assert np.all(np.diff(np.asarray(out)[order]) <= 0)
        np.testing.assert_allclose(soft_topk(x + 37.25, k), out, atol=2e-5)
        np.testing.assert_allclose(soft_topk(x - 1e3, k), out, atol=2e-4)


def test_hard_topk_limit():
    x = jnp.array([0.3, -1.2, 2.5, 0.1, 1.7, -0.4, 0.9])
    hard = np.array([0, 0, 1, 0, 1, 0, 1], np.float32)  # the 3 largest
    errors = [float(jnp.max(jnp.abs(soft_topk(x, 3, temperature=t) - hard))) for t in (1.0, 0.1, 0.01, 1e-3)]
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-6
    np.testing.assert_array_equal(soft_topk(x, 3, temperature=1e-5), hard)


def test_check_grads_rev_and_fwd():
    x = np.array([1.3, -0.4, 0.2, 2.1, -1.5, 0.7])  # no ties, no entry at the threshold
    with jax.enable_x64(True):
        # k = 2 = m: the a = k - m = 0 branch; k = 0.5: m = 0 (S1 empty)
        for k in (2.6, 2.0, 0.5):
            check_grads(lambda v, kk, t: soft_topk(v, kk, temperature=t),
                        (jnp.asarray(x), jnp.float64(k), jnp.float64(0.8)), order=1, modes=("rev", "fwd"))
    # float32: finite, and translation invariance makes every row of the Jacobian sum to 0
    jac = jax.jacrev(lambda v: soft_topk(v, 2.5))(jnp.asarray(x, jnp.float32))
    assert np.all(np.isfinite(jac))
    np.testing.assert_allclose(jnp.sum(jac, axis=1), 0.0, atol=1e-6)


def test_stable_for_inputs_spanning_1e4_and_tiny_temperature():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.permutation(np.linspace(-1e4, 1e4, 301)), jnp.float32)
    for k in (0.5, 1.0, 150.25, 300.0, 300.9):
        out = soft_topk(x, k)
        assert np.all(np.isfinite(out)) and float(out.min()) >= 0 and float(out.max()) <= 1
        assert_sums_to(out, k)
        np.testing.assert_allclose(out, reference_soft_topk(x, k), atol=1e-6)
        grad = jax.grad(lambda v: jnp.sum(soft_topk(v, k) * jnp.arange(301.0)))(x)
        assert np.all(np.isfinite(grad))
    # the fractional entries sit next to +-1e4 with a gap of 2e4 to the other side (hand-computed)
    gap_x = jnp.array([1e4, 1e4 - 1.0, -1e4, -1e4 - 0.5])  # k = 2.3: e^z (1 + e^-1/2) / 2 = 0.3 below
    c = 0.3 / (1.0 + math.exp(-0.5))
    np.testing.assert_allclose(soft_topk(gap_x, 2.3), [1.0, 1.0, c, c * math.exp(-0.5)], atol=2e-7)
    gap_x = jnp.array([1e4 + 0.5, 1e4, -1e4, -1e4 - 3.0])  # k = 1.7: e^-z (1 + e^1/2) / 2 = 0.3 above
    c = 0.3 / (1.0 + math.exp(0.5))
    np.testing.assert_allclose(soft_topk(gap_x, 1.7), [1.0 - c, 1.0 - c * math.exp(0.5), 0.0, 0.0], atol=2e-7)
    y = jnp.asarray(rng.normal(size=301), jnp.float32)
    out = soft_topk(y / 1e-6, 10.5)  # temperature 1e-6
    assert np.all(np.isfinite(out))
    assert_sums_to(out, 10.5)
    assert np.all(np.isfinite(jax.grad(lambda v: jnp.sum(soft_topk(v / 1e-6, 10.5) * jnp.arange(301.0)))(y)))


def test_bfloat16_input_computes_in_float32():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 97)) * 50, jnp.bfloat16)
    out = soft_topk(x, 12.5)
    assert out.dtype == jnp.float32
    assert np.all(np.isfinite(out))
    assert_sums_to(out, 12.5)
    for row in range(4):
        np.testing.assert_allclose(out[row], reference_soft_topk(x[row].astype(jnp.float32), 12.5), atol=2e-6)


def test_batched_with_per_row_budgets():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 40)), jnp.float32)
    k = jnp.array([[1.0, 5.5, 39.0], [0.25, 20.0, 12.0]])
    out = soft_topk(x, k)
    assert out.shape == x.shape
    assert_sums_to(out, k)
    for b in range(2):
        for r in range(3):
            np.testing.assert_allclose(out[b, r], reference_soft_topk(x[b, r], float(k[b, r])), atol=2e-6)
    assert_sums_to(soft_topk(x, jnp.full((3,), 4.0)), np.full((2, 3), 4.0))  # broadcast over leading axes


def test_bad_arguments_name_themselves():
    x = jnp.zeros(5)
    for k in (0, -1.0, 5, 7.5):
        with pytest.raises(ValueError, match=r"k must satisfy 0 < k < n = 5"):
            soft_topk(x, k)
    with pytest.raises(ValueError, match="k must satisfy"):
        soft_topk(jnp.zeros((2, 5)), jnp.array([1.0, 5.0]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        soft_topk(x, 2, temperature=0.0)


@VECTORS
@given(n=st.integers(2, 300), seed=st.integers(0, 2**31 - 1))
def test_property_random_vectors(n, seed):
    rng = np.random.default_rng(seed)
    # two rows per scale, each with its own k in (0, n) and shift: a single compilation per n
    scale_R1 = np.repeat([1e-3, 1.0, 30.0, 1e4], 2)[:, None]
    x = jnp.asarray(rng.normal(size=(8, n)) * scale_R1, jnp.float32)
    k = jnp.asarray(rng.uniform(0.001, 0.999, size=8) * n, jnp.float32)
    shift = jnp.asarray(rng.uniform(-100.0, 100.0, size=(8, 1)), jnp.float32)
    out = np.asarray(soft_topk(x, k))
    assert np.all(np.isfinite(out)) and out.min() >= 0 and out.max() <= 1
    assert_sums_to(out, k)
    for row in range(8):
        np.testing.assert_allclose(out[row], reference_soft_topk(x[row], float(k[row])), atol=2e-6)
        order = np.argsort(-np.asarray(x[row]), kind="stable")
        assert np.all(np.diff(out[row][order]) <= 0)
    # translation invariance, up to the rounding of x + shift (|shift| <= 100: ulp <= 8e-6, |x| <= 1e4 + 100: 1e-3)
    moved = np.asarray(soft_topk(x + shift, k))
    np.testing.assert_allclose(moved[:6], out[:6], atol=2e-5)
    np.testing.assert_allclose(moved[6:], out[6:], atol=2e-3)


# ---------------------------------------------------------------- LKV-H

def randomised_heads(num_layers, kv_heads, seed, scale):
    """``LKVHeads`` with NumPy-drawn weights (built abstractly: no RNG compilation per shape)."""
    heads = nnx.eval_shape(lambda: LKVHeads(num_layers, kv_heads, embed_dim=8, hidden=16, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for name, std in (("embed", 1.0), ("w1", 8 ** -0.5), ("b1", 0.1), ("w2", scale)):
        var = getattr(heads, name)
        var.set_value(jnp.asarray(std * rng.normal(size=var.shape), jnp.float32))
    return heads


def test_heads_start_uniform_and_are_lkv_params():
    heads = LKVHeads(3, 2, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(heads.ratios(0.25), np.full((3, 2), 0.25), rtol=1e-6)
    np.testing.assert_array_equal(heads.budgets(0.25, 100), np.full((3, 2), 25))
    params = nnx.state(heads, LKVParam)
    assert set(params.keys()) == {"embed", "w1", "b1", "w2"}
    assert params["embed"].get_metadata()["logical_axes"] == ("layers", "kv_heads", None)


def test_heads_grouped_by_lkv_attribute_path():
    from kvjax.train.optim import param_group, path_str

    class Holder(nnx.Module):
        def __init__(self):
            self.lkv = LKVHeads(2, 2, rngs=nnx.Rngs(0))

    holder = nnx.eval_shape(Holder)
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(holder, LKVParam))]
    assert paths and all(param_group(p) == "lkv" for p in paths)


@BUDGETS
@given(shape=st.sampled_from([(1, 1), (3, 2), (4, 8)]), keep=st.floats(0.02, 0.98), length=st.integers(1, 5000),
       k_max=st.one_of(st.none(), st.integers(0, 3000)), scale=st.sampled_from([0.5, 5.0, 50.0]),
       seed=st.integers(0, 1000))
def test_property_budgets_respect_total_and_k_max(shape, keep, length, k_max, scale, seed):
    num_layers, kv_heads = shape
    heads = randomised_heads(num_layers, kv_heads, seed, scale)
    r = np.asarray(heads.ratios(keep, temperature=0.7))
    assert r.shape == shape and r.min() >= 0 and r.max() <= 1
    # float32 soft top-k at logit scale 50: the total is exact to ~1e-5 of a head (seen: 1.2e-5 at 6 heads)
    assert_sums_to(r.ravel(), keep * num_layers * kv_heads, atol=1e-4)
    b = np.asarray(heads.budgets(keep, length, k_max, temperature=0.7))
    assert b.dtype == np.int32 and b.shape == shape
    assert b.min() >= 0 and b.max() <= (length if k_max is None else min(k_max, length))
    assert b.sum() <= keep * num_layers * kv_heads * length
    if k_max is None:  # without a cap, flooring loses less than one token per head
        assert b.sum() >= math.floor(keep * num_layers * kv_heads * length) - num_layers * kv_heads


def test_integer_budgets_take_back_rounding_excess():
    # ratios that over-shoot their total (as float32 rounding can): floor(r t) sums to 12 > floor(0.5 * 2 * 10)
    b = integer_budgets(jnp.array([[0.61, 0.65]]), 0.5, 10)
    np.testing.assert_array_equal(b, [[5, 5]])  # fractions 0.1 and 0.5: the smaller pays first, then the other
    np.testing.assert_array_equal(integer_budgets(jnp.array([[0.9, 0.1]]), 0.5, 10, k_max=4), [[4, 1]])
    with pytest.raises(ValueError, match="keep_ratio"):
        integer_budgets(jnp.array([[0.5]]), 1.0, 10)
    with pytest.raises(ValueError, match="length"):
        integer_budgets(jnp.array([[0.5]]), 0.5, 0)
    with pytest.raises(ValueError, match="k_max"):
        integer_budgets(jnp.array([[0.5]]), 0.5, 10, k_max=-1)


# ---------------------------------------------------------------- LKV-T

def test_gumbel_temperature_schedule():
    vals = [float(gumbel_temperature(s, 2.0, 0.02, 100)) for s in (-5, 0, 25, 50, 100, 1000)]
    np.testing.assert_allclose(vals, [2.0, 2.0, 2.0 * 0.01 ** 0.25, 0.2, 0.02, 0.02], rtol=1e-6)
    traced = jax.jit(lambda s: gumbel_temperature(s, 2.0, 0.02, 100))(jnp.arange(0, 101, 10))
    assert np.all(np.diff(np.asarray(traced)) < 0)
    with pytest.raises(ValueError, match="start and end"):
        gumbel_temperature(0, 0.0, 0.1, 10)
    with pytest.raises(ValueError, match="steps"):
        gumbel_temperature(0, 1.0, 0.1, 0)


def test_token_scorer_scores_and_stop_gradient():
    # built abstractly and filled from NumPy (no RNG compilation); LKVHeads covers the random init
    scorer = nnx.eval_shape(lambda: LKVTokenScorer(2, 3, 4, hidden=8, rngs=nnx.Rngs(0)))
    params = nnx.state(scorer, LKVParam)
    assert set(params.keys()) == {"w1", "b1", "w2"}
    assert params["w1"].get_metadata()["logical_axes"] == ("layers", "kv_heads", None, "scorer_hidden")
    rng = np.random.default_rng(4)
    for name in ("w1", "b1", "w2"):
        var = getattr(scorer, name)
        var.set_value(jnp.asarray(0.5 * rng.normal(size=var.shape), jnp.float32))
    k = jnp.asarray(rng.normal(size=(2, 11, 3, 4)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(2, 11, 3, 4)), jnp.bfloat16)
    u = scorer.scores(1, k, v)
    assert u.shape == (2, 3, 11) and u.dtype == jnp.float32
    w1 = np.asarray(scorer.w1[...][1, 2])
    x = np.concatenate([np.asarray(k, np.float32), np.asarray(v, np.float32)], -1)[0, 5, 2]
    hid = np.asarray(jax.nn.silu(x @ w1 + np.asarray(scorer.b1[...][1, 2])))
    np.testing.assert_allclose(u[0, 2, 5], hid @ np.asarray(scorer.w2[...][1, 2]), rtol=1e-5)
    assert not np.any(jax.grad(lambda kk: jnp.sum(scorer.scores(0, kk, v)))(k.astype(jnp.float32)))


def test_gumbel_mask_sums_to_budget_and_hardens():
    u = jnp.asarray(np.random.default_rng(5).normal(size=(2, 3, 32)), jnp.float32)
    rng = jax.random.key(3)
    g = noisy_scores(u, rng, 1.0) - u
    assert float(jnp.abs(jnp.mean(g) - np.euler_gamma)) < 0.15  # standard Gumbel noise, mean gamma
    np.testing.assert_allclose(noisy_scores(u, rng, 0.5), (u + g) / 0.5, rtol=1e-5, atol=1e-5)
    budget = jnp.array([2.0, 5.5, 16.0])
    assert_sums_to(gumbel_topk_mask(u, budget, rng, 1.0), np.broadcast_to(budget, (2, 3)))
    # near zero temperature the mask is the hard top-b of the perturbed scores u + g
    hard = np.asarray(gumbel_topk_mask(u, jnp.full((3,), 4.0), rng, 1e-4))
    ranks = np.argsort(np.argsort(-np.asarray(u + g), axis=-1), axis=-1)
    np.testing.assert_allclose(hard, (ranks < 4).astype(np.float32), atol=1e-6)
