"""Generate a model's own reasoning traces: multi-turn chats sampled with continuous batching.

Prompts (:mod:`kvjax.traces.prompts`) are answered by a
:class:`~kvjax.traces.stream.StreamSampler`: ``batch_size`` rows each hold one
conversation, and a row whose conversation stops takes the next prompt at once. A
conversation shorter than ``min_tokens`` goes on: an answer cut at ``turn_max_new`` keeps
sampling, an answer that ended gets the next follow-up user turn, up to ``max_turns``
turns; every trace is cut at ``max_tokens``. A conversation's sampling keys depend only on
``(seed, prompt index, position)``, so a resumed run regenerates an interrupted
conversation exactly and writes only the traces that are missing.
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
from kvjax.traces.stream import ENDED, RUNNING, TURN_CAP, StreamSampler


SAMPLER = "stream-v1"      # how tokens are drawn; traces of another sampler are not resumed into


@dataclass(frozen=True)
class TraceConfig:
    model_dir: str | None = None          # HF folder; default: SmolLM2 via kvjax.real_model (fetched once)
    out_dir: str = "assets/smollm2-traces"
    num_traces: int = 272                 # prompts 0 .. num_traces-1
    seed: int = 0                         # prompts, sampling and the split
    batch_size: int = 32                  # conversations sampled together (rows of the continuous batch)
    chunk_steps: int = 16                 # decode steps between two looks of the host at the rows
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
        if min(self.num_traces, self.batch_size, self.max_turns, self.turn_max_new, self.chunk_steps) < 1:
            raise ValueError("num_traces, batch_size, chunk_steps, max_turns and turn_max_new must be >= 1")
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


def run_stream(sampler, tok, jobs, cfg: TraceConfig, on_finish) -> tuple[int, int]:
    """Sample the conversations ``jobs`` (``(index, Prompt)`` pairs, in order) with continuous
    batching on ``sampler`` (a :class:`~kvjax.traces.stream.StreamSampler` or a stand-in);
    ``on_finish(conversation)`` gets each as soon as it stops. Returns ``(tokens sampled,
    tokens fed)``.

    A conversation shorter than ``min_tokens`` goes on: a turn cut at ``turn_max_new`` keeps
    sampling, a turn that ended gets the next follow-up (up to ``max_turns`` turns); the
    cache holds ``max_tokens`` positions, where every trace is cut.
    """
    jobs = iter(jobs)
    convs: list[Conversation | None] = [None] * sampler.batch
    pending = [0] * sampler.batch          # forced tokens of the row not fed yet
    sampled = fed_total = 0

    def start(row: int) -> None:
        for index, prompt in jobs:
            ids = encode_prompts(tok, [prompt.messages], chat=True)[0]
            c = Conversation(prompt, ids, len(ids))
            if len(ids) >= cfg.max_tokens:
                c.tokens, c.active = ids[:cfg.max_tokens], False
                on_finish(c)
                continue
            sampler.load(row, ids, index)
            c.tokens = []                       # the prompt comes back with the fed tokens
            convs[row], pending[row] = c, len(ids)
            return
        convs[row] = None
        sampler.idle(row)

    def finish(row: int) -> None:
        convs[row].active = False
        on_finish(convs[row])
        start(row)

    for row in range(sampler.batch):
        start(row)
    while any(c is not None for c in convs):
        fed = sampler.run()
        for row, c in enumerate(convs):
            if c is None:
                continue
            toks = fed[row]
            new = max(0, len(toks) - pending[row])
            pending[row] = max(0, pending[row] - len(toks))
            c.tokens += toks
            c.new_tokens += new
            sampled, fed_total = sampled + new, fed_total + len(toks)
            reason = int(sampler.small["reason"][row])
            if reason == RUNNING:
                continue
            if reason == ENDED:
                c.turns, c.complete = c.turns + 1, True
                room = cfg.max_tokens - len(c.tokens)
                if len(c.tokens) < cfg.min_tokens and c.turns < min(cfg.max_turns, len(c.prompt.followups) + 1) \
                        and room > 0:
                    follow = _turn_tokens(tok, c.prompt.followups[c.turns - 1])[:room]
                    sampler.load(row, follow, reset=False)
                    c.complete, pending[row] = False, len(follow)
                    continue
            elif reason == TURN_CAP and len(c.tokens) < cfg.min_tokens:
                sampler.resume(row)
                continue
            finish(row)
    return sampled, fed_total


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
        mine = {**dataclasses.asdict(cfg), "model_dir": str(folder), "sampler": SAMPLER}
        mine.pop("out_dir")
        if cfg_file.exists() and store.done:
            old = json.loads(cfg_file.read_text())
            free = ("num_traces", "batch_size", "chunk_steps")      # they do not change a trace's tokens
            diff = sorted(k for k in mine if k not in free and old.get(k) != mine[k])
            if diff:
                raise ValueError(f"{cfg.out_dir} holds traces made with other settings ({', '.join(diff)}); "
                                 "pick another out_dir or the same settings")
        cfg_file.write_text(json.dumps(mine, indent=2))
        model = model or kvjax.load_hf(folder, dtype=cfg.dtype)
        tok = tokenizer or transformers.AutoTokenizer.from_pretrained(folder)
        todo = [(i, make_prompt(cfg.seed, i)) for i in range(cfg.num_traces) if prompt_id(i) not in store.done]
        bar = tqdm(total=cfg.num_traces, initial=cfg.num_traces - len(todo), desc="traces", unit="trace",
                   disable=not progress)
        t0 = time.time()

        def write(c: Conversation) -> None:
            store.append([trace_row(c, cfg)])
            bar.update(1)
            bar.set_postfix(tok_s=f"{sampler.fed_tokens / max(time.time() - t0, 1e-9):.1f}")

        sampler = StreamSampler(model, batch=min(cfg.batch_size, max(len(todo), 1)), max_len=cfg.max_tokens,
                                eos_ids=stop_token_ids(model, tok), turn_cap=cfg.turn_max_new,
                                temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed,
                                chunk=cfg.chunk_steps)
        n_gen, n_fed = run_stream(sampler, tok, todo, cfg, write) if todo else (0, 0)
        bar.close()
        wall = time.time() - t0
        summary = {"model_dir": str(folder), "batch_size": cfg.batch_size, "run_wall_s": round(wall, 1),
                   "run_traces": len(todo), "run_sampled_tokens": n_gen, "run_fed_tokens": n_fed,
                   "run_tokens_per_s": round(n_fed / wall, 2) if n_fed else None,
                   "run_sampled_tokens_per_s": round(n_gen / wall, 2) if n_gen else None, "splits": {}}
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
