"""distill_kvpop with the teacher's top-k cached once: the K+1-outcome KL, the cache's exact
resume and refusals, and a cached run that trains like the live teacher's."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.losses import cached_topk_kl, kl_distill
from kvjax.train.config import TrainConfig
from kvjax.train.loop import train
from kvjax.train.teacher_cache import ensure_teacher_cache, load_teacher_cache
from train_helpers import tiny_config


def _logits(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape) * 3.0


def test_cached_kl_is_the_full_kl_when_k_is_the_vocabulary_and_the_bucketed_kl_below_it():
    t, s = _logits(0, (2, 5, 40)), _logits(1, (2, 5, 40))
    mask = jnp.asarray(np.random.RandomState(0).rand(2, 5) > 0.3)
    lt = jax.nn.log_softmax(t, -1)
    full = kl_distill(t, s, mask)
    vals, idx = jax.lax.top_k(lt, 40)
    np.testing.assert_allclose(cached_topk_kl(vals, idx, s, mask), full, rtol=1e-5)
    # K < V: the KL of the (K + 1)-outcome distributions, by hand in numpy
    vals, idx = jax.lax.top_k(lt, 7)
    p = np.exp(np.asarray(lt, np.float64))
    q = np.exp(np.asarray(jax.nn.log_softmax(s, -1), np.float64))
    i = np.asarray(idx)
    pk, qk = np.take_along_axis(p, i, -1), np.take_along_axis(q, i, -1)
    pr, qr = 1 - pk.sum(-1), 1 - qk.sum(-1)
    kl = (pk * np.log(pk / qk)).sum(-1) + pr * np.log(pr / qr)
    m = np.asarray(mask)
    want = (kl * m).sum() / m.sum()
    got = cached_topk_kl(vals, idx, s, mask)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert float(got) < float(full)
    # the student's mass outside the teacher's top-k is paid for: raising it raises the loss
    off = jnp.ones(40, bool).at[i[0, 0]].set(False)
    s_far = s.at[0, 0].add(jnp.where(off, 4.0, 0.0))
    one = jnp.zeros((2, 5), bool).at[0, 0].set(True)
    assert float(cached_topk_kl(vals, idx, s_far, one)) > float(cached_topk_kl(vals, idx, s, one)) + 0.5


def _config(tmp_path, cache, **over):
    rs = np.random.RandomState(0)
    data = tmp_path / "rows.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"tokens": rs.randint(3, 299, rs.randint(40, 70)).tolist()}) + "\n"
                                for _ in range(37)))
    return tiny_config(tmp_path / over.pop("out", "run"), **{
        "mode": "distill_kvpop", "steps": 2, "data.source": "tokens", "data.path": str(data), "data.seq_len": 64,
        "data.batch_size": 4, "data.testbed": {}, "log.every": 1, "optim.lr": 1e-3, "model.init_std": 0.3,
        "eviction": {"sinks": 1, "window": 4, "topk": 4},
        **({"data.teacher_cache": str(cache), "data.teacher_topk": 299} if cache else {}), **over})


def test_a_cached_teacher_trains_like_the_live_teacher(tmp_path):
    live = train(_config(tmp_path, None, out="live"), quiet=True)
    cached = train(_config(tmp_path, tmp_path / "cache", out="cached"), quiet=True)
    assert live["last_metrics"]["kd"] > 1e-4           # the bounded student is not the teacher
    for k in ("kd", "regression", "pairwise", "loss"):
        np.testing.assert_allclose(cached["last_metrics"][k], live["last_metrics"][k], rtol=1e-3, atol=5e-6,
                                   err_msg=k)
    for a, b in zip(jax.tree.leaves(cached["params_tree"]), jax.tree.leaves(live["params_tree"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_the_cache_resumes_a_torn_pass_and_refuses_another_run(tmp_path, capsys):
    cfg = _config(tmp_path, tmp_path / "cache", **{"data.teacher_topk": 5})
    folder = ensure_teacher_cache(cfg, quiet=True)
    logp, idx = load_teacher_cache(cfg, 37)
    assert logp.shape == idx.shape == (37, 64, 5) and logp.dtype == np.float32 and idx.dtype == np.int32
    assert np.all(np.diff(logp, axis=-1) <= 0)                # the teacher's most likely tokens, in order
    # an interrupted pass: one part missing, the meta not yet complete -> only that part is computed again
    (folder / "part-000032.npz").unlink()
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(ValueError, match="incomplete"):
        load_teacher_cache(cfg, 37)
    before = (folder / "part-000000.npz").stat().st_mtime_ns
    ensure_teacher_cache(cfg, quiet=True)
    assert (folder / "part-000000.npz").stat().st_mtime_ns == before
    logp2, idx2 = load_teacher_cache(cfg, 37)
    np.testing.assert_array_equal(idx2, idx)
    np.testing.assert_allclose(logp2, logp, rtol=1e-6)
    # made for another run: refused by name, nothing overwritten
    other = _config(tmp_path, tmp_path / "cache", **{"data.teacher_topk": 6})
    with pytest.raises(ValueError, match="made with topk=5, this run needs 6"):
        ensure_teacher_cache(other, quiet=True)
    with pytest.raises(ValueError, match="made with seq_len=64, this run needs 48"):
        load_teacher_cache(_config(tmp_path, tmp_path / "cache", **{"data.teacher_topk": 5, "data.seq_len": 48}), 37)
    assert json.loads((folder / "meta.json").read_text())["topk"] == 5


def test_config_refuses_a_cache_it_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="eviction.kd_topk renormalises"):
        _config(tmp_path, tmp_path / "c", **{"eviction": {"sinks": 1, "window": 4, "topk": 4, "kd_topk": 8}})
    with pytest.raises(ValueError, match="data.teacher_cache is for mode distill_kvpop"):
        _config(tmp_path, tmp_path / "c", mode="distill_lkv",
                **{"eviction": {"sinks": 1, "window": 4, "topk": 4, "k_max": 8}})
    with pytest.raises(ValueError, match="needs data.source 'tokens'"):
        tiny_config(tmp_path, **{"mode": "distill_kvpop", "steps": 2, "data.teacher_cache": str(tmp_path / "c")})
    assert isinstance(_config(tmp_path, tmp_path / "c"), TrainConfig)
