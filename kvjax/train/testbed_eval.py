"""Held-out testbed evaluation of a model: teacher-forced accuracy per token category,
and answer accuracy under free generation from the ``answer`` word."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

import kvjax
from kvjax.data import EOS_ID, TestbedConfig, batch, category_counts, check_answer, predictions_from_logits


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    h, _ = model(tokens)
    return model.logits(h)


def teacher_forced(model, cfg: TestbedConfig, num: int, seq_len: int, batch_size: int = 32,
                   split: str = "valid") -> dict[str, float]:
    graphdef, params = nnx.split(model)
    totals: dict[str, list[int]] = {}
    for start in range(0, num, batch_size):
        b = batch(cfg, split, start, min(batch_size, num - start), seq_len)
        pred = predictions_from_logits(np.asarray(_logits(graphdef, params, b["tokens"])))
        for k, (c, t) in category_counts(pred, b["tokens"], b["category"]).items():
            acc = totals.setdefault(k, [0, 0])
            acc[0] += c
            acc[1] += t
    return {k: c / t if t else float("nan") for k, (c, t) in totals.items()}


def answer_accuracy(model, cfg: TestbedConfig, num: int, seq_len: int, batch_size: int = 32,
                    split: str = "valid", policy=None, max_new: int = 40) -> float:
    right = 0
    for start in range(0, num, batch_size):
        b = batch(cfg, split, start, min(batch_size, num - start), seq_len)
        prompts = [row[:s].tolist() for row, s in zip(b["tokens"], b["answer_start"])]
        out = np.asarray(kvjax.generate(model, prompts, max_new, policy=policy, eos_token_id=EOS_ID))
        width = out.shape[1] - max_new
        right += sum(check_answer(out[i, width:], int(b["answer"][i])) for i in range(len(prompts)))
    return right / num
