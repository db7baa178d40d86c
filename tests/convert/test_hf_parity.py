"""Logit parity with ``transformers`` (PyTorch, fp32) and the HF round trip."""

import numpy as np
import pytest
import torch
import transformers

import kvjax
from hf_models import LLAMA_CASES, QWEN3_CASES

TOKENS = np.random.RandomState(0).randint(0, 97, (2, 64))


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize("name", list(QWEN3_CASES) + list(LLAMA_CASES))
def test_logits_match_transformers(hf_dir, name):
    folder, ref_model = hf_dir(name)
    model = kvjax.load_hf(folder)
    ref = torch_logits(ref_model, TOKENS)
    got = np.asarray(kvjax.forward(model, TOKENS))
    assert got.dtype == np.float32 and got.shape == (2, 64, 97)
    assert np.abs(ref).max() > 0.05  # logits are not trivially zero
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen3-gqa", "llama-mqa-llama3rope"])
def test_sharded_bf16_checkpoint(tmp_path, name):
    from hf_models import make_hf_model

    ref_model = make_hf_model(name).to(torch.bfloat16)
    ref_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 2
    model = kvjax.load_hf(tmp_path, dtype="float32")
    ref32 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    np.testing.assert_allclose(np.asarray(kvjax.forward(model, TOKENS)), torch_logits(ref32, TOKENS),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen3-mqa-tied", "llama-bias"])
@pytest.mark.parametrize("shard_bytes", [None, 30_000])
def test_round_trip_through_transformers(hf_dir, tmp_path, name, shard_bytes):
    folder, _ = hf_dir(name)
    model = kvjax.load_hf(folder)
    out = tmp_path / "out"
    kw = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
    kvjax.save_hf(model, out, **kw)
    assert (out / "model.safetensors.index.json").exists() == (shard_bytes is not None)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == ("Qwen3ForCausalLM" if name.startswith("qwen3") else "LlamaForCausalLM")
    ours = np.asarray(kvjax.forward(model, TOKENS))
    np.testing.assert_allclose(torch_logits(back, TOKENS), ours, atol=1e-5, rtol=0)
    again = kvjax.load_hf(out)
    np.testing.assert_array_equal(np.asarray(kvjax.forward(again, TOKENS)), ours)


def test_bf16_params_and_compute(hf_dir):
    folder, ref_model = hf_dir("qwen3-gqa")
    ref = torch_logits(ref_model, TOKENS)
    model = kvjax.load_hf(folder, dtype="bfloat16")
    assert model.embed_tokens[...].dtype == np.dtype("bfloat16") and model.dtype == np.dtype("bfloat16")
    got = np.asarray(kvjax.forward(model, TOKENS))
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() < 0.05   # bf16 rounding, not a layout error
    mixed = kvjax.load_hf(folder, dtype="float32", compute_dtype="bfloat16")
    assert mixed.embed_tokens[...].dtype == np.float32
    assert np.abs(np.asarray(kvjax.forward(mixed, TOKENS)) - ref).max() < 0.05
