"""Generate a model's own reasoning traces: batched, jitted sampling of multi-turn chats.

A batch of prompts (:mod:`kvjax.traces.prompts`) is answered with ``kvjax.generate``;
a conversation shorter than ``min_tokens`` goes on: an answer cut at ``turn_max_new``
continues in the next round, an answer that ended gets the next follow-up user turn, up
to ``max_turns`` turns; every trace is cut at ``max_tokens``. Batch ``j``
always holds prompts ``j*B ... j*B+B-1`` and samples with a seed derived from
``(seed, j, turn)``, so a resumed run regenerates an interrupted batch exactly and writes
only the traces that are missing.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from kvjax.text import encode_prompts, stop_token_ids
from kvjax.traces.prompts import Prompt, make_prompt, prompt_id
from kvjax.traces.store import SPLITS, TraceStore


@dataclass(frozen=True)
class TraceConfig:
    model_dir: str | None = None          # HF folder; default: SmolLM2 via kvjax.real_model (fetched once)
    out_dir: str = "runs/traces/smollm2"
    num_traces: int = 272                 # prompts 0 .. num_traces-1
    seed: int = 0                         # prompts, sampling and the split
    batch_size: int = 16                  # conversations sampled together
    min_tokens: int = 512                 # below this a conversation goes on (cut answer or follow-up)
    max_tokens: int = 2048                # every trace is cut here
    turn_max_new: int = 384               # new tokens per assistant turn at most
    max_turns: int = 5                    # assistant turns at most (first + follow-ups)
    temperature: float = 0.7              # sampling (0: greedy)
    top_p: float = 0.9                    # nucleus sampling (1: off)
    top_k: int = 0                        # top-k sampling (0: off)
    split_fractions: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])   # train / valid / test
    dtype: Literal["float32", "bfloat16"] = "float32"   # parameter and compute dtype

    def __post_init__(self):
        if self.num_traces < 1 or self.batch_size < 1 or self.max_turns < 1 or self.turn_max_new < 1:
            raise ValueError("num_traces, batch_size, max_turns and turn_max_new must be >= 1")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens} and {self.max_tokens}")
        if len(self.split_fractions) != 3 or any(f < 0 for f in self.split_fractions) or \
                abs(sum(self.split_fractions) - 1) > 1e-6:
            raise ValueError(f"split_fractions must be three non-negative numbers summing to 1 (train, valid, "
                             f"test), got {self.split_fractions}")


def split_of(seed: int, trace_id: str, fractions) -> str:
    u = random.Random(f"kvjax-split:{seed}:{trace_id}").random()
    edges = np.cumsum(fractions)
    return SPLITS[min(int(np.searchsorted(edges, u, side="right")), 2)]


@dataclass
class Conversation:
    prompt: Prompt
    tokens: list[int]
    prompt_len: int
    turns: int = 0                # assistant turns that ended with an end-of-turn token
    new_tokens: int = 0
    active: bool = True
    complete: bool = False        # the last assistant turn ended (not cut at a length cap)


def _turn_tokens(tok, text: str) -> list[int]:
    """The chat template's tokens for a further user turn, after the assistant's ``<|im_end|>``."""
    msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": text}]
    full = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    head = tok.apply_chat_template(msgs[:1], tokenize=False)
    assert full.startswith(head)
    end = tok.eos_token      # the template writes "<|im_end|>\n"; the model generated "<|im_end|>"
    tail = full[len(head):]
    return tok.encode(("\n" if head.endswith(end + "\n") else "") + tail, add_special_tokens=False)


def run_batch(model, tok, prompts: list[Prompt], cfg: TraceConfig, batch_index: int, generate=None) -> \
        tuple[list[Conversation], int]:
    """Answer one batch of prompts turn by turn; ``(conversations, tokens generated)``."""
    import kvjax

    generate = generate or kvjax.generate
    eos = stop_token_ids(model, tok)
    convs = [Conversation(p, ids, len(ids)) for p, ids in
             zip(prompts, encode_prompts(tok, [p.messages for p in prompts], chat=True))]
    for c in convs:
        if c.prompt_len >= cfg.max_tokens:
            c.tokens, c.active = c.tokens[:cfg.max_tokens], False
    generated = 0
    for rnd in range(cfg.max_turns + 2):   # a turn cut at turn_max_new goes on in the next round
        live = [c for c in convs if c.active]
        if not live:
            break
        # two batch shapes (full, and a quarter for the stragglers of later rounds) bound the compiles
        small = max(1, cfg.batch_size // 4)
        shape = small if len(live) <= small else cfg.batch_size
        rows = [c.tokens for c in live] + [live[0].tokens] * (shape - len(live))
        longest = max(len(r) for r in rows)
        max_new = max(1, min(cfg.turn_max_new, cfg.max_tokens - min(len(c.tokens) for c in live),
                             model.config.max_position_embeddings - longest))
        out = np.asarray(generate(model, rows, max_new, temperature=cfg.temperature, top_p=cfg.top_p,
                                  top_k=cfg.top_k, seed=cfg.seed * 1_000_003 + batch_index * 101 + rnd,
                                  eos_token_id=eos))
        for c, row in zip(live, out[:, longest:]):
            hit = np.flatnonzero(np.isin(row, eos))
            c.complete = hit.size > 0
            piece = row[: hit[0] + 1] if c.complete else row
            c.tokens += [int(t) for t in piece]
            c.turns += int(c.complete)
            c.new_tokens += len(piece)
            generated += len(piece)
            if len(c.tokens) >= cfg.min_tokens:
                c.active = False
            elif c.complete:              # ask the next follow-up, if any are left
                if c.turns < min(cfg.max_turns, len(c.prompt.followups) + 1):
                    c.tokens += _turn_tokens(tok, c.prompt.followups[c.turns - 1])
                else:
                    c.active = False
            c.tokens = c.tokens[: cfg.max_tokens]
            c.active = c.active and len(c.tokens) < cfg.max_tokens
    return convs, generated


def trace_row(c: Conversation, cfg: TraceConfig) -> dict:
    return {"id": c.prompt.id, "kind": c.prompt.kind, "split": split_of(cfg.seed, c.prompt.id, cfg.split_fractions),
            "tokens": c.tokens, "prompt_len": c.prompt_len, "turns": c.turns, "new_tokens": c.new_tokens,
            "complete": c.complete, "answer": c.prompt.answer}


def length_summary(lengths) -> dict:
    a = np.asarray(lengths)
    if a.size == 0:
        return {"count": 0}
    hist, edges = np.histogram(a, bins=[0, 256, 512, 768, 1024, 1536, 2048, 10**9])
    return {"count": int(a.size), "min": int(a.min()), "median": float(np.median(a)), "mean": float(a.mean()),
            "max": int(a.max()),
            "histogram": {f"{int(lo)}-{int(hi) if hi < 10**9 else 'inf'}": int(n)
                          for lo, hi, n in zip(edges[:-1], edges[1:], hist)}}


def generate_traces(cfg: TraceConfig, *, model=None, tokenizer=None, progress: bool = True) -> dict:
    """Write ``cfg.num_traces`` traces under ``cfg.out_dir`` (resuming); returns the run summary."""
    import transformers
    from tqdm import tqdm

    import kvjax
    from kvjax.real_model import ensure_model

    store = TraceStore(cfg.out_dir)
    try:
        folder = Path(cfg.model_dir) if cfg.model_dir else ensure_model()
        cfg_file = Path(cfg.out_dir) / "trace_config.json"
        mine = {**dataclasses.asdict(cfg), "model_dir": str(folder)}
        mine.pop("out_dir")
        if cfg_file.exists() and store.done:
            old = json.loads(cfg_file.read_text())
            diff = sorted(k for k in mine if k != "num_traces" and old.get(k) != mine[k])
            if diff:
                raise ValueError(f"{cfg.out_dir} holds traces made with other settings ({', '.join(diff)}); "
                                 "pick another out_dir or the same settings")
        cfg_file.write_text(json.dumps(mine, indent=2))
        model = model or kvjax.load_hf(folder, dtype=cfg.dtype)
        tok = tokenizer or transformers.AutoTokenizer.from_pretrained(folder)
        B = cfg.batch_size
        n_batches = -(-cfg.num_traces // B)
        t_gen, n_gen, t0 = 0.0, 0, time.time()
        bar = tqdm(total=cfg.num_traces, initial=sum(1 for i in range(cfg.num_traces)
                                                       if prompt_id(i) in store.done),
                   desc="traces", unit="trace", disable=not progress)
        for j in range(n_batches):
            idx = range(j * B, min((j + 1) * B, cfg.num_traces))
            if all(prompt_id(i) in store.done for i in idx):
                continue
            prompts = [make_prompt(cfg.seed, i) for i in range(j * B, (j + 1) * B)]   # whole batch: same seeds
            t1 = time.time()
            convs, n = run_batch(model, tok, prompts, cfg, j)
            t_gen, n_gen = t_gen + time.time() - t1, n_gen + n
            rows = [trace_row(c, cfg) for c, i in zip(convs, range(j * B, (j + 1) * B)) if i < cfg.num_traces]
            missing = [r for r in rows if r["id"] not in store.done]
            store.append(missing)
            bar.update(len(missing))
            bar.set_postfix(tok_s=f"{n_gen / max(t_gen, 1e-9):.1f}")
        bar.close()
        summary = {"model_dir": str(folder), "batch_size": B, "run_wall_s": round(time.time() - t0, 1),
                   "run_generated_tokens": n_gen,
                   "run_tokens_per_s": round(n_gen / t_gen, 2) if t_gen else None, "splits": {}}
        lengths = []
        for split in SPLITS:
            rows = store.rows(split)
            summary["splits"][split] = length_summary([len(r["tokens"]) for r in rows])
            lengths += [len(r["tokens"]) for r in rows]
        summary["all"] = length_summary(lengths)
        summary["in_range"] = int(sum(cfg.min_tokens <= n <= cfg.max_tokens for n in lengths))
        (Path(cfg.out_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        store.close()
