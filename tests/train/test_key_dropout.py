"""Key dropout: permanent random eviction outside a window, per layer, as a training backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models.decoder import causal_attention
from kvjax.train.config import Phase
from kvjax.train.key_dropout import key_dropout_attention, rate_at


def _qkv(S=40):
    rs = np.random.RandomState(0)
    q = jnp.asarray(rs.randn(2, S, 4, 8), jnp.float32)
    k = jnp.asarray(rs.randn(2, S, 2, 8), jnp.float32)
    v = jnp.asarray(rs.randn(2, S, 2, 8), jnp.float32)
    return q, k, v, jnp.broadcast_to(jnp.arange(S), (2, S))


def test_rate_zero_is_causal_attention():
    q, k, v, pos = _qkv()
    got, _ = key_dropout_attention(jax.random.key(0), 0.0, 4)(0, q, k, v, pos, None)
    want, _ = causal_attention(0, q, k, v, pos, None)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("layer", [0, 1])
def test_a_dropped_key_is_gone_for_every_later_query_but_never_inside_the_window(layer):
    """Perturb one value: queries within the window always see it; the queries beyond see it
    all or none (the eviction is permanent); the sink (position 0) is never dropped."""
    S, w = 40, 5
    q, k, v, pos = _qkv(S)
    backend = key_dropout_attention(jax.random.key(3), 0.5, w)
    base, _ = backend(layer, q, k, v, pos, None)
    kinds = set()
    for t in range(0, 30):
        out, _ = backend(layer, q, k, v.at[:, t].add(1.0), pos, None)
        changed = np.abs(np.asarray(out - base)).max(axis=(2, 3)) > 1e-6          # [B, S]
        assert not changed[:, :t].any()
        assert changed[:, t : t + w].all()
        beyond = changed[:, t + w :]
        assert (beyond.all(1) | ~beyond.any(1)).all()
        kinds |= set(beyond.all(1).tolist())
        if t == 0:
            assert beyond.all()
    assert kinds == {True, False}                                                   # some kept, some dropped
    other, _ = key_dropout_attention(jax.random.key(3), 0.5, w)(layer + 1, q, k, v, pos, None)
    assert not np.allclose(np.asarray(other), np.asarray(base))                     # layers drop independently


def test_rate_follows_the_phase():
    rates, steps = [0.0, 0.3, 0.1], [10, 5, 7]
    got = [float(rate_at(rates, steps, jnp.int32(s))) for s in (0, 9, 10, 14, 15, 21)]
    np.testing.assert_allclose(got, [0.0, 0.0, 0.3, 0.3, 0.1, 0.1])


@pytest.mark.parametrize("kw, msg", [({"key_dropout": 1.0}, "key_dropout must be in"),
                                      ({"key_dropout": -0.1}, "key_dropout must be in"),
                                      ({"key_dropout_window": 0}, "key_dropout_window must be")])
def test_phase_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Phase(steps=1, **kw)


def test_pretrain_loss_uses_key_dropout_only_in_its_phase(tmp_path):
    """The pretrain loss equals the dense loss in a phase without key dropout and differs in one with it."""
    from train_helpers import tiny_config

    from kvjax.data import batch as make_batch
    from kvjax.train.data import testbed_config
    from kvjax.train.tasks import make_task

    cfg = tiny_config(tmp_path, steps=0, phases=[{"steps": 3}, {"steps": 3, "key_dropout": 0.5, "key_dropout_window": 4}])
    task = make_task(cfg)
    dense = make_task(tiny_config(tmp_path, steps=6))
    b = make_batch(testbed_config(cfg.data), "train", 0, 4, 128)
    b = {k: jnp.asarray(b[k]) for k in task.batch_keys}
    loss = lambda t, step: float(t.loss_fn(task.params, None, b, jax.random.key(0), jnp.int32(step))[0])
    assert loss(task, 1) == loss(dense, 1)
    assert np.isfinite(loss(task, 4)) and loss(task, 4) != loss(dense, 4)
    with pytest.raises(ValueError, match="share one key_dropout_window"):
        make_task(tiny_config(tmp_path, steps=0, phases=[{"steps": 1, "key_dropout": 0.1, "key_dropout_window": 4},
                                                         {"steps": 1, "key_dropout": 0.1}]))
