"""Top-k / top-p filtering against ``transformers``' warpers, sampling and length buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from kvjax.sampling import bucket, check_sampling, filter_logits, sample_logits


@pytest.mark.parametrize("top_k,top_p,vocab,scale", [
    (5, 1.0, 50, 3), (0, 0.5, 50, 3), (0, 0.9, 50, 3), (20, 0.8, 50, 3), (1, 1.0, 50, 3), (0, 1e-4, 50, 3),
    # a vocabulary larger than the 256 candidates: peaked (the cut lies among them), flat (full
    # sort), top-k beyond them (full sort), top-k within them
    (0, 0.9, 2000, 8), (0, 0.9, 2000, 0.5), (300, 0.95, 2000, 1), (100, 0.9, 2000, 0.5), (600, 1.0, 2000, 1)])
def test_kept_set_matches_transformers_warpers(top_k, top_p, vocab, scale):
    logits = np.random.RandomState(0).randn(6, vocab).astype(np.float32) * scale
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), jnp.int32(top_k), jnp.float32(top_p))))
    x = torch.tensor(logits)
    if top_k:
        x = transformers.TopKLogitsWarper(top_k)(None, x)
    if top_p < 1:
        x = transformers.TopPLogitsWarper(top_p)(None, x)
    want = np.isfinite(x.numpy())
    np.testing.assert_array_equal(got, want)
    assert got.sum(-1).min() >= 1


def test_samples_stay_in_the_kept_set_and_follow_the_seed():
    logits = jnp.asarray(np.random.RandomState(1).randn(4, 30).astype(np.float32))
    allowed = np.isfinite(np.asarray(filter_logits(logits, jnp.int32(3), jnp.float32(1.0))))
    keys = jax.random.split(jax.random.key(0), 200)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: sample_logits(logits, k, 1.0, jnp.int32(3), jnp.float32(1.0))))(keys))
    assert all(allowed[b, draws[:, b]].all() for b in range(4))
    assert len(set(draws[:, 0].tolist())) == 3          # all three kept tokens are drawn
    greedy = np.asarray(sample_logits(logits, jax.random.key(0), 0.0))
    np.testing.assert_array_equal(greedy, np.asarray(logits).argmax(-1))
    one = np.asarray(sample_logits(logits, jax.random.key(5), 2.0, jnp.int32(1), jnp.float32(1.0)))
    np.testing.assert_array_equal(one, greedy)


@pytest.mark.parametrize("bad,match", [(dict(temperature=float("nan")), "temperature must be a finite"),
                                       (dict(temperature=-1.0), "temperature must be >= 0"),
                                       (dict(top_p=0.0), "top_p must lie in"),
                                       (dict(top_p=1.5), "top_p must lie in"),
                                       (dict(top_k=-2), "top_k must be a non-negative"),
                                       (dict(top_k=2.5), "top_k must be a non-negative")])
def test_bad_sampling_settings_are_refused(bad, match):
    kw = {**dict(temperature=1.0, top_k=0, top_p=1.0), **bad}
    with pytest.raises(ValueError, match=match):
        check_sampling(**kw)


def test_buckets_pad_at_most_a_quarter_and_are_few():
    sizes = range(1, 8193)
    assert all(n <= bucket(n) <= max(32, n * 1.25) for n in sizes)
    assert len({bucket(n) for n in sizes}) <= 40
    assert [bucket(n) for n in (1, 32, 33, 100, 1000, 1025)] == [32, 32, 40, 112, 1024, 1280]
