"""Padded numpy batches of testbed problems, for a trainer or an evaluation loop.

Problems are addressed by `(split, index)`, so a batch is random access and a
trainer can shard or resume a stream by its start index.
"""

from __future__ import annotations

import numpy as np

from kvjax.data.config import TestbedConfig
from kvjax.data.testbed import Problem, generate_problem
from kvjax.data.vocab import PAD_ID


def collate(problems: list[Problem], seq_len: int) -> dict[str, np.ndarray]:
    """Pad problems into a batch of `seq_len` columns.

    tokens int32 [B, S] (pad id after the end); loss_mask bool [B, S], true on
    real tokens except position 0 (targets of next-token prediction); category
    int8 [B, S] (`other` on padding); last_use int32 [B, S]; and int32 [B]
    length, prompt_len, answer_start, answer_pos, answer.
    """
    if any(len(p) > seq_len for p in problems):
        raise ValueError(f"seq_len {seq_len} is shorter than a problem ({max(len(p) for p in problems)} tokens)")
    n = len(problems)
    out = {
        "tokens": np.full((n, seq_len), PAD_ID, np.int32),
        "loss_mask": np.zeros((n, seq_len), bool),
        "category": np.zeros((n, seq_len), np.int8),
        "last_use": np.full((n, seq_len), -1, np.int32),
    }
    for row, p in enumerate(problems):
        out["tokens"][row, : len(p)] = p.tokens
        out["loss_mask"][row, 1 : len(p)] = True
        out["category"][row, : len(p)] = p.category
        out["last_use"][row, : len(p)] = p.last_use
    for key in ("prompt_len", "answer_start", "answer_pos", "answer"):
        out[key] = np.array([getattr(p, key) for p in problems], np.int32)
    out["length"] = np.array([len(p) for p in problems], np.int32)
    return out


def batch(cfg: TestbedConfig, split: str, start: int, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """Problems `start .. start + batch_size - 1` of `split`, collated (see `collate`)."""
    if seq_len < cfg.length:
        raise ValueError(f"seq_len {seq_len} must be >= TestbedConfig.length {cfg.length}")
    return collate([generate_problem(cfg, split, start + i) for i in range(batch_size)], seq_len)


def iter_batches(cfg: TestbedConfig, split: str, batch_size: int, seq_len: int, start: int = 0):
    """Endless batches of consecutive problems from `start` on."""
    while True:
        yield batch(cfg, split, start, batch_size, seq_len)
        start += batch_size


def step_batches(cfg: TestbedConfig, split: str, batch_size: int, seq_len: int, *, positions: str = "all"):
    """``batch_at(step) -> (tokens int32 [B, S], mask float32 [B, S])``: problems ``step * B ..``
    of ``split`` for a trainer that takes plain token batches (DMS, DuoAttention). ``mask`` marks
    the *predicting* positions (position ``t`` predicts token ``t + 1``): ``"all"`` every real
    next token, ``"retrieval"`` only the lookups and the answer line (what a retrieval head
    serves)."""
    from kvjax.data.testbed import LOOKUP_FAR, LOOKUP_NEAR

    if positions not in ("all", "retrieval"):
        raise ValueError(f"positions must be 'all' or 'retrieval', got {positions!r}")

    def batch_at(step: int):
        b = batch(cfg, split, step * batch_size, batch_size, seq_len)
        target = b["loss_mask"]
        if positions == "retrieval":
            answer = np.arange(seq_len)[None, :] >= b["answer_start"][:, None]
            target = target & (np.isin(b["category"], (LOOKUP_NEAR, LOOKUP_FAR)) | answer)
        mask = np.zeros((batch_size, seq_len), np.float32)
        mask[:, :-1] = target[:, 1:]
        return b["tokens"], mask

    return batch_at
