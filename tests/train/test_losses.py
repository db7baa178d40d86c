"""Losses against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.losses import (boundary_pairs, boundary_pairwise_loss, hidden_mse, kl_distill, regression_loss,
                          topk_kl_distill)


def test_regression_ignores_tokens_without_target():
    r_hat = jnp.array([[[1.0, 2.0, 3.0]]])
    tgt = jnp.array([[[0.0, 4.0, -jnp.inf]]])
    assert float(regression_loss(r_hat, tgt)) == pytest.approx((1.0 + 4.0) / 2)
    # a token with a target but no score (the mLSTM's last w under a reconstruction target) is left out
    unread = r_hat.at[0, 0, 1].set(-jnp.inf)
    assert float(regression_loss(unread, tgt)) == pytest.approx(1.0)
    g = jax.grad(lambda r: regression_loss(r, tgt))(unread)
    assert bool(jnp.isfinite(g).all()) and float(g[0, 0, 1]) == 0.0


def test_centred_regression_is_the_loss_at_the_best_offset_per_row():
    # row 0: differences (1, -2) on the tokens with a target -> offset -0.5 -> (1.5, -1.5)
    # row 1: differences (3, 3, 3) -> offset 3 -> 0 (a pure offset costs nothing)
    r_hat = jnp.array([[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]])
    tgt = jnp.array([[[0.0, 4.0, -jnp.inf], [1.0, 2.0, 3.0]]])
    want = (1.5 ** 2 + 1.5 ** 2 + 0 + 0 + 0) / 5
    assert float(regression_loss(r_hat, tgt, centred=True)) == pytest.approx(want)
    shifted = r_hat + jnp.array([[[7.0], [-2.0]]])
    assert float(regression_loss(shifted, tgt, centred=True)) == pytest.approx(want)
    assert float(regression_loss(shifted, tgt)) != pytest.approx(want)
    # an unread score (-inf, the mLSTM's last w tokens) is left out, not a NaN
    r_hat = r_hat.at[0, 0, 1].set(-jnp.inf)
    assert float(regression_loss(r_hat, tgt, centred=True)) == pytest.approx(0.0)
    g = jax.grad(lambda r: regression_loss(r, tgt, centred=True))(r_hat)
    assert bool(jnp.all(jnp.isfinite(g)))


def test_kl_hand_computed():
    t = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))
    s = jnp.log(jnp.array([[[0.25, 0.5, 0.25]]]))
    want = 0.5 * np.log(2) + 0.25 * np.log(0.5)
    assert float(kl_distill(t, s, jnp.ones((1, 1)))) == pytest.approx(want, abs=1e-6)
    # top-2 of the teacher = tokens 0 and 1 (ties broken by index): renormalise both sides
    t2 = jnp.log(jnp.array([[[0.6, 0.3, 0.1]]]))
    pt = np.array([2 / 3, 1 / 3])
    ps = np.array([0.25, 0.5]) / 0.75
    assert float(topk_kl_distill(t2, s, jnp.ones((1, 1)), 2)) == pytest.approx(float(np.sum(pt * np.log(pt / ps))),
                                                                                 abs=1e-6)
    assert float(kl_distill(t, t, jnp.ones((1, 1)))) == pytest.approx(0.0, abs=1e-7)


def test_boundary_pairs_hand_example():
    # s=0, w=1, k=1; targets by token: [5, 1, 3, 4, 0]
    tgt = jnp.array([[[5.0, 1.0, 3.0, 4.0, 0.0]]])
    t, c, keep, valid = boundary_pairs(tgt, sinks=0, window=1, topk=1)
    # q=2: E={0,1}, budget full; t=1 (1 < 5): dropped, cutoff token 0
    # q=3: E={0,1,2}; t=2 dropped; cutoff token 0.  q=4: E={0..3}; t=3 dropped; cutoff 0
    assert np.asarray(valid)[0, 0].tolist() == [False, False, True, True, True]
    assert np.asarray(c)[0, 0, 2:].tolist() == [0, 0, 0]
    assert np.asarray(keep)[0, 0, 2:].tolist() == [False, False, False]
    tgt2 = jnp.array([[[1.0, 0.0, 3.0, 2.0, 5.0]]])
    _, c2, keep2, _ = boundary_pairs(tgt2, sinks=0, window=1, topk=1)
    # q=3: t=2 (3 > 1) kept, it is the new cutoff token itself; q=4: t=3 (2 < 3) dropped vs cutoff 2
    assert np.asarray(keep2)[0, 0, 3:].tolist() == [True, False]
    assert np.asarray(c2)[0, 0, 3:].tolist() == [2, 2]


def test_boundary_loss_value_and_balance():
    tgt = jnp.array([[[1.0, 0.0, 3.0, 2.0, 5.0]]])
    p_hat = jnp.zeros((1, 1, 5))
    loss = boundary_pairwise_loss(p_hat, tgt, sinks=0, window=1, topk=1, margin=1.0)
    # all student differences are 0 -> every weighted term is softplus(0) = log 2, weights sum to 1
    assert float(loss) == pytest.approx(np.log(2), abs=1e-6)
    good = boundary_pairwise_loss(10 * tgt, tgt, sinks=0, window=1, topk=1)
    assert float(good) < 0.01 < float(boundary_pairwise_loss(-10 * tgt, tgt, sinks=0, window=1, topk=1))


def test_hidden_mse_hand_computed():
    a = [jnp.zeros((1, 2, 2)), jnp.ones((1, 2, 2))]
    b = [jnp.ones((1, 2, 2)), jnp.ones((1, 2, 2)) * 3]
    assert float(hidden_mse(a, b, jnp.ones((1, 2)))) == pytest.approx(1.0 + 4.0)
