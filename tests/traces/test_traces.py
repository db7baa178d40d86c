"""The trace CLI: prompts, the turn logic, resumable split files, and what train.py reads."""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers

import kvjax
from kvjax.convert.hf_io import COMPANION_FILES
from kvjax.real_model import ensure_model
from kvjax.traces import TraceConfig, generate_traces, make_prompt
from kvjax.traces.run import run_batch
from kvjax.traces.store import TraceStore


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer (fast to run)."""
    real = ensure_model()
    folder = tmp_path_factory.mktemp("tiny-chat")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    for name in COMPANION_FILES:
        if (real / name).exists() and name != "generation_config.json":
            shutil.copy(real / name, folder / name)
    return folder


def test_prompts_are_seeded_and_offline():
    a, b = make_prompt(0, 7), make_prompt(0, 7)
    assert a == b and make_prompt(1, 7) != a
    kinds = {make_prompt(0, i).kind for i in range(6)}
    assert kinds == {"arithmetic", "reasoning", "passage"}
    p = make_prompt(0, 2)
    assert p.kind == "passage" and len(p.messages[0]["content"]) > 1000 and len(p.followups) >= 3
    q = make_prompt(0, 0)
    assert q.answer is not None and q.messages[0]["content"].count("step by step") >= 1


class ScriptedGenerate:
    """Stands in for ``kvjax.generate``: row r of round k writes ``lengths[k][r]`` tokens of 7,
    then EOS when ``ends[k][r]``."""

    def __init__(self, lengths, ends):
        self.lengths, self.ends, self.calls = lengths, ends, []

    def __call__(self, model, rows, max_new, **kw):
        k = len(self.calls)
        self.calls.append((len(rows), max_new))
        S = max(map(len, rows))
        out = np.full((len(rows), S + max_new), 2, np.int32)
        for r in range(len(rows)):
            n = min(self.lengths[k][r] if r < len(self.lengths[k]) else 1, max_new)
            out[r, S:S + n] = 7
            if n < max_new and (self.ends[k][r] if r < len(self.ends[k]) else True):
                out[r, S + n] = 2
            elif n < max_new:
                out[r, S + n:] = 7
        return out


def test_turn_logic_continues_cut_answers_and_asks_followups(tiny_chat_model):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    model = kvjax.load_hf(tiny_chat_model)
    cfg = TraceConfig(batch_size=4, min_tokens=300, max_tokens=420, turn_max_new=100, max_turns=3)
    prompts = [make_prompt(0, i) for i in (0, 1, 3, 4)]       # short prompts (~170-200 tokens)
    # round 0: row 0 ends after 10 tokens, rows 1-3 are cut at 100 (no EOS)
    # round 1: row 0 (after a follow-up) ends after 5; rows 1-3 are long enough or continue
    script = ScriptedGenerate(lengths=[[10, 100, 100, 100], [5, 100, 100, 100], [100] * 4, [100] * 4],
                              ends=[[True, False, False, False], [True, False, False, False],
                                    [False] * 4, [False] * 4])
    convs, n = run_batch(model, tok, prompts, cfg, 0, generate=script)
    c0 = convs[0]
    assert c0.turns >= 2 and c0.tokens[c0.prompt_len:c0.prompt_len + 11] == [7] * 10 + [2]
    follow = tok.decode(c0.tokens[c0.prompt_len + 11:c0.prompt_len + 60])
    assert follow.startswith("\n<|im_start|>user\n" + c0.prompt.followups[0][:20])
    for c in convs:
        assert cfg.min_tokens <= len(c.tokens) <= cfg.max_tokens or c.turns == cfg.max_turns
    assert not convs[1].complete and convs[1].turns == 0 and convs[1].new_tokens >= 100
    assert n == sum(c.new_tokens for c in convs)
    assert all(b in (1, 4) for b, _ in script.calls)      # the full and the quarter batch shape only


def _read(folder):
    rows = {}
    for split in ("train", "valid", "test"):
        f = folder / f"{split}.jsonl"
        if f.exists():
            for line in f.read_text().splitlines():
                r = json.loads(line)
                assert r["id"] not in rows
                rows[r["id"]] = r
    return rows


def test_run_resumes_after_a_torn_write_without_loss_or_duplicates(tiny_chat_model, tmp_path):
    cfg = TraceConfig(model_dir=str(tiny_chat_model), out_dir=str(tmp_path / "tr"), num_traces=6, batch_size=3,
                      min_tokens=240, max_tokens=900, turn_max_new=32, max_turns=2,
                      split_fractions=[0.5, 0.25, 0.25])
    summary = generate_traces(cfg, progress=False)
    first = _read(tmp_path / "tr")
    assert sorted(first) == sorted(make_prompt(0, i).id for i in range(6))
    assert summary["all"]["count"] == 6 and summary["run_tokens_per_s"] > 0
    assert {r["split"] for r in first.values()} <= {"train", "valid", "test"}
    for r in first.values():
        assert r["tokens"][:r["prompt_len"]] == kvjax.text.encode_prompts(
            transformers.AutoTokenizer.from_pretrained(tiny_chat_model), [make_prompt(0, int(r["id"][-6:])).messages])[0]
    # a kill mid-write: the last line of one file torn, the other files' last traces lost
    biggest = max((tmp_path / "tr").glob("*.jsonl"), key=lambda f: f.stat().st_size)
    data = biggest.read_bytes()
    biggest.write_bytes(data[: data.rfind(b"\n", 0, len(data) - 1) + 40])
    generate_traces(cfg, progress=False)
    again = _read(tmp_path / "tr")
    assert again == first                     # same traces, each once (regenerated exactly)
    more = generate_traces(TraceConfig(**{**cfg.__dict__, "num_traces": 8}), progress=False)
    assert more["all"]["count"] == 8 and set(first) <= set(_read(tmp_path / "tr"))
    with pytest.raises(ValueError, match="other settings .*temperature"):
        generate_traces(TraceConfig(**{**cfg.__dict__, "temperature": 0.3}), progress=False)
    store = TraceStore(tmp_path / "tr")
    try:
        with pytest.raises(RuntimeError, match="in use by another trace run"):
            generate_traces(cfg, progress=False)
    finally:
        store.close()
    from kvjax.train.data import JsonlTokenSource

    split = next(iter(first.values()))["split"]
    src = JsonlTokenSource(str(tmp_path / "tr" / f"{split}.jsonl"), 256)
    row = src[0]
    assert row["tokens"].shape == (256,) and row["tokens"][0] == 1      # <|im_start|> of the chat template


def test_bad_trace_config_is_refused():
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        TraceConfig(min_tokens=900, max_tokens=512)
    with pytest.raises(ValueError, match="split_fractions"):
        TraceConfig(split_fractions=[0.5, 0.5, 0.5])
