"""Scorer export: round trip in kvjax, a plain PyTorch reference reproduces the scores,
and export straight from a distill_kvpop run."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file

import kvjax
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.learned import from_scorer
from kvjax.export import export_scorers, load_scorers
from kvjax.scorers import MLPScorer, MLSTMScorer

L, K, D, W = 2, 2, 16, 3


def torch_mlp_scores(t, layer, x):
    """x [S, K, 2D] -> r [K, S]."""
    h = torch.nn.functional.silu(torch.einsum("skx,kxf->skf", x, t["mlp.w1"][layer]) + t["mlp.b1"][layer])
    return (torch.einsum("skf,kf->sk", h, t["mlp.w2"][layer]) + t["mlp.b2"][layer]).T


def torch_mlstm_scores(t, layer, x, window, readout_norm):
    """Recurrent stabilised mLSTM with delayed readout: x [S, K, 2D] -> r [K, S] (-inf unread)."""
    S = x.shape[0]
    g = lambda n: t[f"mlstm.{n}"][layer]  # noqa: E731
    d = g("wq").shape[-1]
    q = torch.einsum("skx,kxd->skd", x, g("wq"))
    k = torch.einsum("skx,kxd->skd", x, g("wk")) / d ** 0.5
    v = torch.einsum("skx,kxe->ske", x, g("wv"))
    i = torch.einsum("skx,kx->sk", x, g("wi")) + g("bi")
    logf = torch.nn.functional.logsigmoid(torch.einsum("skx,kx->sk", x, g("wf")) + g("bf"))
    C = torch.zeros(K, d, v.shape[-1])
    n = torch.zeros(K, d)
    m = torch.zeros(K)
    r = torch.full((K, S), float("-inf"))
    for s in range(S):
        m_new = torch.maximum(logf[s] + m, i[s])
        fa, ia = torch.exp(logf[s] + m - m_new), torch.exp(i[s] - m_new)
        C = fa[:, None, None] * C + ia[:, None, None] * k[s][:, :, None] * v[s][:, None, :]
        n = fa[:, None] * n + ia[:, None] * k[s]
        m = m_new
        tok = s - window
        if tok >= 0:
            u = q[tok]
            h = torch.einsum("kde,kd->ke", C, u) / torch.maximum((n * u).sum(-1).abs(), torch.exp(-m))[:, None]
            if readout_norm:
                h = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6)
            r[:, tok] = (torch.nn.functional.silu(h) * g("head_w")).sum(-1) + g("head_b")
    return r


@pytest.mark.parametrize("kind", ["mlp", "mlstm", "mlstm-no-norm"])
def test_round_trip_and_pytorch_reference(tmp_path, kind):
    norm = kind == "mlstm"
    sc = (MLPScorer(L, K, D, rngs=nnx.Rngs(3)) if kind == "mlp" else
          MLSTMScorer(L, K, D, 8, readout_norm=norm, rngs=nnx.Rngs(3)))
    kind = kind.removesuffix("-no-norm")
    policy = from_scorer(sc, EvictionConfig(sinks=1, window=W, topk=5))
    out = export_scorers(policy, tmp_path / "exported", base_model_name="tiny")
    meta = json.loads((out / "scorer_config.json").read_text())
    assert meta["scorer"] == kind and meta["window"] == W and meta["base_model"] == "tiny"
    assert meta.get("readout_norm") == (norm if kind == "mlstm" else None)
    back = load_scorers(out)
    rs = np.random.RandomState(0)
    k = jnp.asarray(rs.randn(1, 40, K, D).astype(np.float32))
    v = jnp.asarray(rs.randn(1, 40, K, D).astype(np.float32))
    t = jnp.arange(40)[None]
    for layer in range(L):
        a = np.asarray(policy.priority(policy.params, layer, k, v, t))
        b = np.asarray(back.priority(back.params, layer, k, v, t))
        np.testing.assert_array_equal(a, b)
        tensors = load_file(out / "scorers.safetensors")
        x = torch.cat([torch.tensor(np.asarray(k[0])), torch.tensor(np.asarray(v[0]))], -1)
        ref = torch_mlp_scores(tensors, layer, x) if kind == "mlp" else torch_mlstm_scores(tensors, layer, x, W, norm)
        lam = torch.nn.functional.softplus(tensors["decay_raw"][layer])
        ref = (ref + lam[:, None] * torch.arange(40)[None]).numpy()
        np.testing.assert_allclose(a[0], ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(meta["decays"])[layer], lam.numpy(), rtol=1e-6)


def test_mlstm_export_without_readout_norm_field_loads_as_before_the_norm(tmp_path):
    """Exports written before ``readout_norm`` existed scored without it, and still do."""
    sc = MLSTMScorer(L, K, D, 8, readout_norm=False, rngs=nnx.Rngs(3))
    out = export_scorers(from_scorer(sc, EvictionConfig(sinks=1, window=W, topk=5)), tmp_path / "old")
    meta = json.loads((out / "scorer_config.json").read_text())
    del meta["readout_norm"]
    (out / "scorer_config.json").write_text(json.dumps(meta))
    back = load_scorers(out)
    assert back.scorer(back.params).readout_norm is False
    rs = np.random.RandomState(1)
    k, v = (jnp.asarray(rs.randn(1, 30, K, D).astype(np.float32)) for _ in range(2))
    t = jnp.arange(30)[None]
    normed = from_scorer(MLSTMScorer(L, K, D, 8, rngs=nnx.Rngs(3)), EvictionConfig(sinks=1, window=W, topk=5))
    a, b = (np.asarray(p.priority(p.params, 0, k, v, t)) for p in (back, normed))
    fin = np.isfinite(a)
    assert np.abs(a[fin] - b[fin]).max() > 1e-3          # the two readouts are different scorers


def test_export_from_a_distill_run(tmp_path):
    from kvjax.train.loop import train
    from train_helpers import TINY_MODEL, tiny_config

    teacher = kvjax.Decoder(kvjax.ModelConfig.from_hf_config(TINY_MODEL), rngs=nnx.Rngs(0))
    kvjax.save_hf(teacher, tmp_path / "teacher")
    cfg = tiny_config(tmp_path / "run", steps=2, mode="distill_kvpop",
                      **{"model": {"hf_path": str(tmp_path / "teacher")},
                         "eviction": {"sinks": 2, "window": 8, "topk": 16, "kvpop": {"scorer": "mlstm", "mlstm_qk_dim": 8}}})
    train(cfg, quiet=True)
    out = export_scorers(tmp_path / "run", tmp_path / "scorers")
    meta = json.loads((out / "scorer_config.json").read_text())
    assert meta["scorer"] == "mlstm" and meta["base_config_sha256"] and meta["topk"] == 16
    gen = kvjax.generate(teacher, [[1, 5, 9, 13]], 20, policy=load_scorers(out), eos_token_id=[])
    assert gen.shape == (1, 24)
    with pytest.raises(FileNotFoundError, match="scorers.safetensors: missing"):
        load_scorers(tmp_path)
    # one checkpoint's state (here the last, step 2): the same scorers and the student backbone
    from kvjax.export import export_checkpoint

    scorers, student = export_checkpoint(tmp_path / "run", tmp_path / "at2", 2)
    assert (scorers / "scorers.safetensors").read_bytes() == (out / "scorers.safetensors").read_bytes()
    assert kvjax.load_hf(student).config == teacher.config
    # the pair: the scorers know their adapted backbone; with it they load quietly, with the original
    # (frozen) weights they load and say so
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_scorers(scorers, model=kvjax.load_hf(student))
    with pytest.warns(UserWarning, match="trained with an adapted backbone .* not as the pair that was trained"):
        load_scorers(scorers, model=kvjax.load_hf(tmp_path / "teacher"))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 1 \(kept: \[2\]\)"):
        export_checkpoint(tmp_path / "run", tmp_path / "at1", 1)
    # quality against steps: the step's scorers on its student and on the teacher, one evaluation
    from kvjax.evaluation.checkpoint_curve import checkpoint_curve

    res = checkpoint_curve(tmp_path / "run", [2], tmp_path / "curve", num_problems=2, batch_size=2)
    rows = {r["policy"]: r for r in res["rows"]}
    assert set(rows) == {"dense", "s2", "s2_teacher"} and all(r["problems"] == 2 for r in rows.values())
    assert (tmp_path / "curve" / "step-2" / "student" / "config.json").exists()
    with pytest.raises(ValueError, match="a distill_kvpop run is needed"):
        (tmp_path / "pre").mkdir()
        (tmp_path / "pre" / "config.json").write_text(json.dumps({"mode": "pretrain"}))
        checkpoint_curve(tmp_path / "pre", [2], tmp_path / "c2")


def test_lkv_round_trip_budgets_and_pytorch_reference(tmp_path):
    from kvjax.eviction.lkv_policies import LKV, LKVBudgetsKVpopMLSTM, lkv_budgets_policy, lkv_policy
    from kvjax.lkv import LKVHeads, LKVTokenScorer

    heads = LKVHeads(L, K, 8, 16, rngs=nnx.Rngs(0))
    heads.w2.set_value(jnp.asarray(np.random.RandomState(4).randn(16).astype(np.float32)))
    ev = EvictionConfig(sinks=1, window=W, topk=6, k_max=10)
    policy = lkv_policy(heads, LKVTokenScorer(L, K, D, 16, rngs=nnx.Rngs(5)), ev)
    back = load_scorers(export_scorers(policy, tmp_path / "lkv"), compression=None)
    assert isinstance(back, LKV) and back.config == ev
    np.testing.assert_array_equal(np.asarray(back.params["budgets"]), np.asarray(policy.params["budgets"]))
    rs = np.random.RandomState(1)
    k = jnp.asarray(rs.randn(1, 30, K, D).astype(np.float32))
    v = jnp.asarray(rs.randn(1, 30, K, D).astype(np.float32))
    tensors = load_file(tmp_path / "lkv" / "scorers.safetensors")
    x = torch.cat([torch.tensor(np.asarray(k[0])), torch.tensor(np.asarray(v[0]))], -1)
    for layer in range(L):
        u = np.asarray(back.priority(back.params, layer, k, v, jnp.arange(30)[None]))[0]
        h = torch.nn.functional.silu(torch.einsum("skx,kxf->skf", x, tensors["lkv.w1"][layer]) + tensors["lkv.b1"][layer])
        np.testing.assert_allclose(u, torch.einsum("skf,kf->ks", h, tensors["lkv.w2"][layer]).numpy(), atol=1e-5)
    combo = lkv_budgets_policy(heads, MLSTMScorer(L, K, D, 8, rngs=nnx.Rngs(3)), ev)
    back = load_scorers(export_scorers(combo, tmp_path / "combo"), compression=None)
    assert isinstance(back, LKVBudgetsKVpopMLSTM)
    np.testing.assert_array_equal(np.asarray(back.params["budgets"]), np.asarray(combo.params["budgets"]))
    meta = json.loads((tmp_path / "combo" / "scorer_config.json").read_text())
    assert meta["scorer"] == "mlstm" and meta["k_max"] == 10 and len(meta["lkv_budgets"]) == L


def test_combine_lkv_budgets_with_a_kvpop_mlstm_export(tmp_path):
    """``combine_lkv_budgets``: an exported LKV's budgets + an exported KVpop mLSTM scorer ->
    ``lkv_kvpop_mlstm`` whose token priorities are the mLSTM's and budgets the LKV's."""
    from kvjax.eviction.lkv_policies import LKVBudgetsKVpopMLSTM, lkv_policy
    from kvjax.export import combine_lkv_budgets
    from kvjax.lkv import LKVHeads, LKVTokenScorer

    heads = LKVHeads(L, K, 8, 16, rngs=nnx.Rngs(0))
    heads.w2.set_value(jnp.asarray(np.random.RandomState(4).randn(16).astype(np.float32)))
    ev = EvictionConfig(sinks=1, window=W, topk=6, k_max=10)
    lkv = lkv_policy(heads, LKVTokenScorer(L, K, D, 16, rngs=nnx.Rngs(5)), ev)
    kvpop = from_scorer(MLSTMScorer(L, K, D, 8, rngs=nnx.Rngs(3)), EvictionConfig(sinks=1, window=W, topk=9))
    out = combine_lkv_budgets(export_scorers(lkv, tmp_path / "lkv"), export_scorers(kvpop, tmp_path / "kv"),
                              tmp_path / "combo")
    combo = load_scorers(out, compression=None)
    assert isinstance(combo, LKVBudgetsKVpopMLSTM) and combo.config == ev
    np.testing.assert_array_equal(np.asarray(combo.params["budgets"]), np.asarray(lkv.params["budgets"]))
    rs = np.random.RandomState(2)
    k = jnp.asarray(rs.randn(1, 30, K, D).astype(np.float32))
    v = jnp.asarray(rs.randn(1, 30, K, D).astype(np.float32))
    t = jnp.arange(30)[None]
    np.testing.assert_allclose(np.asarray(combo.priority(combo.params, 1, k, v, t)),
                               np.asarray(kvpop.priority(kvpop.params, 1, k, v, t)), atol=1e-6)
    with pytest.raises(ValueError, match="expected exported LKV scorers"):
        combine_lkv_budgets(tmp_path / "kv", tmp_path / "kv", tmp_path / "bad")
