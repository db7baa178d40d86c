"""Bad input to load_hf / save_hf / ModelConfig names the problem; failed saves lose nothing."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kvjax
from kvjax.config import PRESETS, ModelConfig, preset


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(folder, fn):
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_missing_folder_and_files(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        kvjax.load_hf(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        kvjax.load_hf(tmp_path)
    folder = copy(hf_dir("qwen3-gqa")[0], tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        kvjax.load_hf(folder)


def test_missing_extra_misshaped_tensors(tmp_path, hf_dir):
    src = hf_dir("qwen3-gqa")[0]
    f = copy(src, tmp_path / "missing")
    rewrite_weights(f, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(KeyError, match="missing tensor 'model.layers.1.self_attn.k_norm.weight'"):
        kvjax.load_hf(f)
    f = copy(src, tmp_path / "extra")
    rewrite_weights(f, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", np.zeros(3, np.float32)))
    with pytest.raises(KeyError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        kvjax.load_hf(f)
    f = copy(src, tmp_path / "shape")
    rewrite_weights(f, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight",
                                               np.zeros((64, 31), np.float32)))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight' has shape \(64, 31\), "
                                         r"expected \(64, 32\)"):
        kvjax.load_hf(f)


def test_missing_shard_file(tmp_path):
    from hf_models import make_hf_model

    make_hf_model("llama-gqa").save_pretrained(tmp_path, max_shard_size="20KB")
    sorted(tmp_path.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(FileNotFoundError, match="shard named in model.safetensors.index.json"):
        kvjax.load_hf(tmp_path)


def test_unsupported_architecture(tmp_path, hf_dir):
    f = copy(hf_dir("llama-gqa")[0], tmp_path / "m")
    cfg = json.loads((f / "config.json").read_text())
    (f / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type: unsupported architecture 'mistral'"):
        kvjax.load_hf(f)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    ({"hidden_act": "gelu"}, "hidden_act: only 'silu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling: unsupported rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling: llama3 scaling is missing"),
    ({"head_dim": None, "hidden_size": 30}, "head_dim: absent"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
])
def test_inconsistent_config_fields(change, message):
    base = ModelConfig("llama", 97, 32, 64, 2, 4, 2, 8).to_hf_config()
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**base, **change})
    missing = dict(base)
    missing.pop("num_hidden_layers")
    with pytest.raises(ValueError, match="missing required field 'num_hidden_layers'"):
        ModelConfig.from_hf_config(missing)


def test_presets_round_trip_through_hf_config():
    for name, cfg in PRESETS.items():
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg, name
    assert preset("qwen3-4b").head_dim == 128 and preset("qwen3-4b").hidden_size // 32 == 80
    with pytest.raises(ValueError, match="preset: unknown model 'gpt-9'"):
        preset("gpt-9")


def test_hf_config_classes_accept_ours():
    import transformers

    for name in ("qwen3-0.6b", "llama-3.1-8b"):
        hf = preset(name).to_hf_config()
        cls = transformers.AutoConfig.for_model(hf["model_type"])
        obj = type(cls).from_dict(hf)
        assert ModelConfig.from_hf_config(obj.to_dict()) == preset(name)


def test_failed_save_keeps_previous_folder(tmp_path, hf_dir, monkeypatch):
    model = kvjax.load_hf(hf_dir("qwen3-gqa")[0])
    out = tmp_path / "out"
    kvjax.save_hf(model, out)
    (out / "tokenizer.json").write_text("{}")
    before = (out / "model.safetensors").read_bytes()

    import kvjax.convert.hf_io as hf_io

    def boom(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(hf_io, "save_file", boom)
    with pytest.raises(OSError, match="No space left"):
        kvjax.save_hf(model, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]    # no temporary folder left behind
    monkeypatch.undo()
    kvjax.save_hf(model, out)     # a good save keeps the non-weight files already there
    assert (out / "tokenizer.json").read_text() == "{}"
