"""`data.lookup_weight`: the pretrain loss weighs lookup tokens by it, and bad values are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train_helpers import tiny_config

from kvjax.configio import ConfigError, load_config
from kvjax.data import batch as make_batch
from kvjax.data.testbed import LOOKUP_FAR, LOOKUP_NEAR
from kvjax.train.config import TrainConfig
from kvjax.train.data import testbed_config as config_of
from kvjax.train.tasks import make_task


def test_loss_is_the_lookup_weighted_mean_of_token_losses(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, **{"data.lookup_weight": 4.0})
    task = make_task(cfg)
    b = make_batch(config_of(cfg.data), "train", 0, 4, 128)
    assert set(task.batch_keys) == {"tokens", "loss_mask", "category"}
    loss = float(task.loss_fn(task.params, None, {k: jnp.asarray(b[k]) for k in task.batch_keys},
                              jax.random.key(0), jnp.int32(0))[0])

    from flax import nnx

    m = nnx.merge(task.graphdef, task.params)
    h, _ = m(jnp.asarray(b["tokens"]))
    logp = np.asarray(jax.nn.log_softmax(m.logits(h)[:, :-1].astype(jnp.float32), -1))
    nll = -np.take_along_axis(logp, b["tokens"][:, 1:, None], -1)[..., 0]
    lookup = np.isin(b["category"][:, 1:], [LOOKUP_NEAR, LOOKUP_FAR])
    assert lookup.sum() > 10
    w = b["loss_mask"][:, 1:] * np.where(lookup, 4.0, 1.0)
    np.testing.assert_allclose(loss, (nll * w).sum() / w.sum(), rtol=1e-5)
    plain = (nll * b["loss_mask"][:, 1:]).sum() / b["loss_mask"][:, 1:].sum()
    assert abs(loss - plain) > 1e-4  # the weighting changed the loss (untrained: every token costs ~log V)


def test_bad_lookup_weight_is_refused():
    with pytest.raises(ConfigError, match="data.lookup_weight must be > 0"):
        load_config(TrainConfig, None, ["data.lookup_weight=0", "steps=3"])
    with pytest.raises(ConfigError, match="lookup_weight needs data.source 'testbed'"):
        load_config(TrainConfig, None, ["data.source=tokens", "data.path=x.jsonl", "data.lookup_weight=2",
                                        "steps=3"])
