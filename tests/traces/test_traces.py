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
from kvjax.traces.run import run_stream
from kvjax.traces.store import TraceStore
from kvjax.traces.stream import ENDED, FULL, IDLE, RUNNING, TURN_CAP, StreamSampler


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


class ScriptedSampler:
    """Stands in for :class:`StreamSampler` with the same stall rules: conversation ``k``'s
    turn ``t`` samples ``turns[k][t] = (n, ends)``: ``n`` tokens of 7, then EOS (2) if ``ends``."""

    def __init__(self, batch, max_len, turn_cap, turns, chunk=16):
        self.batch, self.max_len, self.turn_cap, self.turns, self.chunk = batch, max_len, turn_cap, turns, chunk
        self.small = {"reason": np.full(batch, IDLE)}
        self.rows = [None] * batch
        self.loads = []

    def load(self, row, tokens, key_id=None, *, reset=True):
        if reset:
            self.rows[row] = {"key": key_id, "pos": 0, "turn": 0, "made": 0}
        self.rows[row].update(forced=list(tokens), gen=0)
        self.loads.append((row, self.rows[row]["key"], len(tokens), reset))
        self.small["reason"][row] = RUNNING

    def resume(self, row):
        self.rows[row]["gen"] = 0
        self.small["reason"][row] = RUNNING

    def idle(self, row):
        self.small["reason"][row] = IDLE

    def run(self):
        out = []
        for row, r in enumerate(self.rows):
            fed = []
            while self.small["reason"][row] == RUNNING and len(fed) < self.chunk:
                n, ends = self.turns[r["key"]][min(r["turn"], len(self.turns[r["key"]]) - 1)]
                if r["forced"]:
                    fed.append(r["forced"].pop(0))
                    r["pos"] += 1
                else:
                    tok = 2 if (ends and r["made"] == n) else 7
                    fed.append(tok)
                    r["pos"], r["gen"], r["made"] = r["pos"] + 1, r["gen"] + 1, r["made"] + 1
                    if tok == 2:
                        r["turn"], r["made"] = r["turn"] + 1, 0
                        self.small["reason"][row] = ENDED
                        break
                    if r["gen"] >= self.turn_cap:
                        self.small["reason"][row] = TURN_CAP
                if r["pos"] >= self.max_len:
                    self.small["reason"][row] = FULL
            out.append(fed)
        return out


def test_turn_logic_continues_cut_answers_and_asks_followups(tiny_chat_model):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    cfg = TraceConfig(batch_size=2, min_tokens=300, max_tokens=420, turn_max_new=100, max_turns=2)
    jobs = [(i, make_prompt(0, i)) for i in (0, 1, 3, 4)]       # short prompts (~170-200 tokens)
    # conversation 0 ends after 10 tokens, then (after a follow-up of ~106 tokens) after 5;
    # 1 and 4 never end (cut at turn_max_new, then sampling on while short); 3 ends at once every turn
    turns = {0: [(10, True), (5, True), (500, False)], 1: [(1000, False)], 3: [(0, True)], 4: [(1000, False)]}
    sampler = ScriptedSampler(2, cfg.max_tokens, cfg.turn_max_new, turns)
    done = []
    n_sampled, n_fed = run_stream(sampler, tok, jobs, cfg, done.append)
    got = {int(c.prompt.id[-6:]): c for c in done}
    assert sorted(got) == [0, 1, 3, 4]
    assert [k for _, k, _, reset in sampler.loads if reset] == [0, 1, 3, 4]   # rows refilled in order
    c0 = got[0]
    assert c0.turns == 2 and c0.tokens[c0.prompt_len:c0.prompt_len + 11] == [7] * 10 + [2]
    follow = tok.decode(c0.tokens[c0.prompt_len + 11:c0.prompt_len + 60])
    assert follow.startswith("\n<|im_start|>user\n" + c0.prompt.followups[0][:20])
    c1 = got[1]     # cut at 100 sampled tokens while short: sampling went on until min_tokens
    assert not c1.complete and c1.turns == 0 and len(c1.tokens) >= cfg.min_tokens
    assert c1.new_tokens == len(c1.tokens) - c1.prompt_len and len(c1.tokens) - cfg.min_tokens < 100
    c3 = got[3]     # every answer empty: follow-ups until max_turns, then it stops short
    assert c3.turns == cfg.max_turns and c3.complete and len(c3.tokens) < cfg.min_tokens
    assert got[4].new_tokens == 200 and not got[4].complete
    for c in done:
        assert len(c.tokens) <= cfg.max_tokens and not c.active
        assert c.tokens[:c.prompt_len] == kvjax.text.encode_prompts(tok, [c.prompt.messages])[0]
    assert n_sampled == sum(c.new_tokens for c in done)
    assert n_fed == sum(len(c.tokens) for c in done)


def test_stream_sampler_equals_generate_greedy_in_recycled_rows(tiny_chat_model):
    """Two rows, three prompts: the third runs in a row whose cache still holds another
    conversation; every answer equals ``kvjax.generate``'s, token for token."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    model = kvjax.load_hf(tiny_chat_model)
    prompts = kvjax.text.encode_prompts(tok, ["Name a river.", "What is two plus two? Explain in detail.", "Hi"])
    new = 24
    want = [np.asarray(kvjax.generate(model, [p], new, eos_token_id=(99999 % 49152,)))[0, -new:].tolist()
            for p in prompts]
    s = StreamSampler(model, batch=2, max_len=256, eos_ids=(49151,), turn_cap=new, temperature=0.0, chunk=8)
    got = {}
    queue = list(enumerate(prompts))
    live = {}
    for row in range(2):
        k, p = queue.pop(0)
        s.load(row, p, k)
        live[row] = (k, [])
    while live:
        fed = s.run()
        for row in list(live):
            k, toks = live[row]
            toks += fed[row]
            if s.small["reason"][row] != RUNNING:
                got[k] = toks
                del live[row]
                if queue:
                    k2, p2 = queue.pop(0)
                    s.load(row, p2, k2)
                    live[row] = (k2, [])
                else:
                    s.idle(row)
    for k, p in enumerate(prompts):
        assert got[k][:len(p)] == p
        assert got[k][len(p):] == want[k], k


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
                      min_tokens=240, max_tokens=900, turn_max_new=32, max_turns=2, top_p=1.0,
                      split_fractions=[0.5, 0.25, 0.25])    # top_p 1: no vocabulary sort per step (fast)
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
