"""Scorer-only KVpop: the teacher-feature pass (features and targets equal a direct
computation, resumable, refuses other inputs) and the fit (learns, resumes exactly, exports)."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import kvjax
from kvjax.eviction.kvzip import RepeatPrompts, reconstruction_scores
from kvjax.eviction.prompt_compressed import _context_cache
from kvjax.models.attention import dense_attention
from kvjax.scorer_fit import FeatureConfig, FeatureSplit, FitConfig, build_features, fit_scorers
from kvjax.targets import future_attention_target, peak_future_attention

WINDOW = 4
# a reconstruction request for the tokenizer-less tiny model: a 3-token template head, 2 sinks,
# chunks of 24 tokens (the longer traces are reconstructed in 2-3 passes)
PROMPTS = RepeatPrompts(head=3, first=(5, 6, 7), later=(8, 9), suffix=(10, 11), sinks=2, chunk=24, postfix=3)


@pytest.fixture(scope="module")
def model():
    cfg = kvjax.ModelConfig("llama", 97, 32, 64, 2, 4, 2, 16, max_position_embeddings=512)
    return kvjax.Decoder(cfg, rngs=nnx.Rngs(0), init_std=0.3, embed_init_std=1.0)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    rs = np.random.RandomState(0)
    for split, lengths in (("train", [40, 57, 33, 64, 48, 51]), ("valid", [45, 38])):
        with open(d / f"{split}.jsonl", "w") as f:
            for i, n in enumerate(lengths):
                f.write(json.dumps({"id": f"{split}-{i}", "tokens": rs.randint(0, 97, n).tolist(),
                                    "prompt_len": 5}) + "\n")
    return d


@pytest.fixture(scope="module")
def features(model, traces, tmp_path_factory):
    out = tmp_path_factory.mktemp("feat")
    build_features(FeatureConfig(traces_dir=str(traces), out_dir=str(out), window=WINDOW), model=model,
                   progress=False, prompts=PROMPTS)
    return out


def _direct(model, tokens):
    """Per-layer ``[k; v]`` and the mean / peak targets of one unpadded trace."""
    got = []

    def capture(layer, q, k, v, positions, acc):
        out, lse = dense_attention(q, k, v, positions, positions)
        got.append((np.concatenate([k[0], v[0]], -1),
                    np.asarray(future_attention_target(q, k, window=WINDOW, lse=lse))[0],
                    np.asarray(peak_future_attention(q, k, window=WINDOW, lse=lse))[0]))
        return out, acc

    model(jnp.asarray([tokens], jnp.int32), None, capture, ())
    return got


def test_features_equal_a_direct_forward_of_each_trace(model, traces, features):
    split = FeatureSplit(features / "train")
    rows = [json.loads(line) for line in (traces / "train.jsonl").read_text().splitlines()]
    assert len(split) == 6 and split.window == WINDOW
    for i in (0, 3):                                    # traces of different (bucketed) lengths
        direct = _direct(model, rows[i]["tokens"])
        x, mean, peak = split.x_of(i), split.targets_of(i, "mean"), split.targets_of(i, "peak")
        union = split.targets_of(i, "union")
        assert x.dtype == ml_dtypes.bfloat16 and x.shape == (len(rows[i]["tokens"]), 2, 2, 32)
        for layer, (xv, m, p) in enumerate(direct):
            np.testing.assert_allclose(x[:, layer].astype(np.float32), xv, rtol=1e-2, atol=1e-2)
            np.testing.assert_allclose(mean[:, layer].T, m, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(peak[:, layer].T, p, rtol=1e-4, atol=1e-5)
            assert np.array_equal(np.isfinite(union[:, layer].T), np.isfinite(m))
        assert np.isneginf(mean[-WINDOW:]).all() and np.isfinite(mean[:-WINDOW]).all()
        fin = union[np.isfinite(union)]
        assert 0 <= fin.min() and fin.max() < 1          # percentile ranks


def test_reconstruction_targets_are_kvzip_scores_of_the_trace_as_a_context(model, traces, features):
    """``recon`` / ``recon_plus`` equal ``log`` of the kvzip / kvzip_plus policies' own scores of
    the trace prefilled as a context (the same function on a fresh dense cache), with the sinks
    untargeted and the unreconstructed template head floored at its head's smallest score."""
    split = FeatureSplit(features / "train")
    rows = [json.loads(line) for line in (traces / "train.jsonl").read_text().splitlines()]
    graphdef, params = nnx.split(model)
    for i in (1, 3):                                    # 57 and 64 tokens: 3 reconstruction chunks
        tokens = rows[i]["tokens"]
        dense = _context_cache(graphdef, params, jnp.asarray([tokens], jnp.int32))
        for target, plus in (("recon", False), ("recon_plus", True)):
            s = np.asarray(reconstruction_scores(model, dense.k, dense.v, [tokens], PROMPTS, plus=plus))[:, 0]
            got = split.targets_of(i, target)                                        # [n, L, K]
            assert np.isneginf(got[:PROMPTS.sinks]).all() and np.isfinite(got[PROMPTS.sinks:]).all()
            body = np.log(s[..., PROMPTS.head:len(tokens)])                          # [L, K, n - head]
            np.testing.assert_allclose(np.transpose(got[PROMPTS.head:], (1, 2, 0)), body, rtol=1e-4, atol=1e-4)
            floor = np.transpose(got[PROMPTS.sinks:PROMPTS.head], (1, 2, 0))         # template head past sinks
            np.testing.assert_allclose(floor, np.broadcast_to(body.min(-1, keepdims=True), floor.shape), rtol=1e-5)
        assert not np.allclose(split.targets_of(i, "recon"), split.targets_of(i, "recon_plus"))


def test_feature_pass_resumes_and_refuses_other_inputs(model, traces, features, tmp_path):
    import shutil

    copy = tmp_path / "feat"
    shutil.copytree(features, copy)
    before = (copy / "train" / "x.u16").read_bytes()
    # a stop after 2 traces: the rest of the file is garbage, progress says 2
    data = bytearray(before)
    cut = FeatureSplit(copy / "train").offsets[2] * 2 * 2 * 32 * 2
    data[cut:] = b"\x07" * (len(data) - cut)
    (copy / "train" / "x.u16").write_bytes(bytes(data))
    (copy / "train" / "progress.json").write_text(json.dumps({"done": 2}))
    with pytest.raises(ValueError, match="unfinished .2 of 6"):
        FeatureSplit(copy / "train")
    build_features(FeatureConfig(traces_dir=str(traces), out_dir=str(copy), window=WINDOW), model=model,
                   progress=False, prompts=PROMPTS)
    assert (copy / "train" / "x.u16").read_bytes() == before
    with pytest.raises(ValueError, match="other inputs .*window"):
        build_features(FeatureConfig(traces_dir=str(traces), out_dir=str(copy), window=WINDOW + 1), model=model,
                       progress=False, prompts=PROMPTS)
    with pytest.raises(FileNotFoundError, match="run python -m kvjax.traces first"):
        build_features(FeatureConfig(traces_dir=str(tmp_path / "none"), out_dir=str(tmp_path / "f2")), model=model,
                       progress=False)


def _fit(features, out, **kw):
    cfg = FitConfig(**{"features_dir": str(features), "out_dir": str(out), "steps": 8, "batch_traces": 3,
                       "warmup_steps": 2, "lr": 1e-2, "hidden": 16, "qk_dim": 8, "chunk": 16, "sinks": 2, "topk": 8,
                       "checkpoint_every": 4, "base_model_name": "tiny", **kw})
    return fit_scorers(cfg, progress=False, say=lambda *_: None)


@pytest.mark.parametrize("scorer,target,decay", [("mlp", "mean", None), ("mlstm", "union", None),
                                                ("mlp", "recon_plus", 0.0), ("mlp", "recon", 2e-3),
                                                ("mlstm", "recon", 0.0)])     # targets where the mLSTM has no read
def test_fit_learns_and_exports_loadable_scorers(model, features, tmp_path, scorer, target, decay):
    s = _fit(features, tmp_path / "fit", scorer=scorer, target=target, steps=40, decay=decay, centred=decay is None)
    decays = np.asarray(json.loads((tmp_path / "fit" / "export" / "scorer_config.json").read_text())["decays"])
    np.testing.assert_allclose(decays, np.full((2, 2), 9.1147e-4 if decay is None else decay), rtol=1e-4, atol=1e-30)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "fit" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 40 and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    v = s["valid"]
    assert np.asarray(v["recall_by_head"]).shape == (2, 2) and 0 <= v["recall_mean"] <= 1
    policy = kvjax.load_scorers(tmp_path / "fit" / "export", model=model, compression=None)
    assert policy.name == f"kvpop_{scorer}" and policy.config.window == WINDOW and policy.config.topk == 8
    out = kvjax.generate(model, [[1, 2, 3] * 10], 6, policy=policy)    # runs as an eviction policy
    assert out.shape == (1, 36)


def test_fit_resumes_exactly_after_a_stop(features, tmp_path):
    _fit(features, tmp_path / "a")
    _fit(features, tmp_path / "b")
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "8")          # stopped after the step-4 checkpoint
    s = _fit(features, tmp_path / "b")
    assert s["steps_run"] == 4
    a, b = (load_file(str(tmp_path / r / "export" / "scorers.safetensors")) for r in ("a", "b"))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    with pytest.raises(Exception, match="differs"):
        _fit(features, tmp_path / "b", lr=3e-2)


@pytest.mark.parametrize("kw,match", [({"target": "median"}, "target must be one of .*recon_plus"),
                                      ({"decay": -0.1}, "decay must be in .0, 1."),
                                      ({"scorer": "gru"}, "scorer must be 'mlp' or 'mlstm'")])
def test_bad_fit_configs_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        FitConfig(**kw)
