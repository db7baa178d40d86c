"""Scoring on the testbed: per-category teacher-forced accuracy, answer checks, statistics.

Teacher forcing: `pred[b, t]` is the model's guess for `tokens[b, t]` (the
argmax of the logits at position `t - 1`; `predictions_from_logits` does the
shift). Every category but `other` is scored; `graded` pools the lookups and
the computation (`POOLED`), the answer line's copies (`copy_name`, `copy_op`)
are reported on their own, and `answer_line` counts the rows whose whole answer
line (from `answer_start` to `<eos>`) is predicted right.

Free generation: prompt the model with `tokens[:answer_start]`, let it write
until `<eos>`, and give the new tokens to `check_answer`.
"""

from __future__ import annotations

import numpy as np

from kvjax.data.config import TestbedConfig
from kvjax.data.testbed import CATEGORIES, COMPUTE, LINE_KINDS, LOOKUP_FAR, LOOKUP_NEAR, OTHER, generate_problem
from kvjax.data.vocab import EOS_ID, PAD_ID, id_to_number, is_name, tok

GRADED = tuple(name for name in CATEGORIES if name != "other")
POOLED = ("lookup_near", "lookup_far", "compute")       # the `graded` pool
POOLED_IDS = tuple(CATEGORIES.index(name) for name in POOLED)


def predictions_from_logits(logits) -> np.ndarray:
    """`[B, S, V]` logits → int32 `[B, S]` predictions aligned with the tokens (-1 at position 0)."""
    guess = np.asarray(logits).argmax(-1).astype(np.int32)
    return np.concatenate([np.full_like(guess[:, :1], -1), guess[:, :-1]], axis=1)


def category_counts(pred, tokens, category, answer_start=None) -> dict[str, tuple[int, int]]:
    """`{name: (correct, total)}` for each graded category and `graded` (the `POOLED` ones);
    with `answer_start` `[B]`, also `answer_line`: (rows whose every answer-line token, up to
    and including `<eos>`, is right, rows)."""
    pred, tokens, category = np.asarray(pred), np.asarray(tokens), np.asarray(category)
    correct = pred == tokens
    masks = {name: category == CATEGORIES.index(name) for name in GRADED}
    masks["graded"] = np.isin(category, POOLED_IDS)
    out = {name: (int(correct[m].sum()), int(m.sum())) for name, m in masks.items()}
    if answer_start is not None:
        cols = np.arange(tokens.shape[1])[None, :]
        eos = np.where(tokens == EOS_ID, cols, tokens.shape[1]).min(axis=1)        # [B]
        line = (cols >= np.asarray(answer_start)[:, None]) & (cols <= eos[:, None])
        out["answer_line"] = (int(np.all(correct | ~line, axis=1).sum()), len(tokens))
    return out


def category_accuracy(pred, tokens, category, answer_start=None) -> dict[str, float]:
    """Teacher-forced accuracy per graded category (NaN where a category is empty); see
    `category_counts`."""
    return {name: c / t if t else float("nan")
            for name, (c, t) in category_counts(pred, tokens, category, answer_start).items()}


def parse_answer(generated) -> int | None:
    """The value a generated answer line states, or None if it is malformed.

    Expects `n1 v1 -> v1 op n2 v2 -> r ... ;` (then `<eos>` or padding):
    the answer is the number just before the first `;`, which must follow `->`.
    """
    ids = [int(i) for i in np.asarray(generated).reshape(-1)]
    for stop in (EOS_ID, PAD_ID):
        if stop in ids:
            ids = ids[: ids.index(stop)]
    if tok(";") not in ids:
        return None
    line = ids[: ids.index(tok(";"))]
    if len(line) < 2 or line[-2] != tok("->") or not is_name(line[0]):
        return None
    return id_to_number(line[-1])


def check_answer(generated, answer: int) -> bool:
    """Whether generated tokens (from `answer_start` on) state `answer`."""
    return parse_answer(generated) == int(answer)


def answer_accuracy(generated_BT, answers_B) -> float:
    """Fraction of rows whose generated answer is right."""
    rows = np.asarray(generated_BT)
    return float(np.mean([check_answer(row, a) for row, a in zip(rows, np.asarray(answers_B))]))


def dataset_statistics(cfg: TestbedConfig, split: str = "valid", num_problems: int = 32) -> dict:
    """Lengths, category fractions, lookup distances and marker predictiveness of a sample."""
    problems = [generate_problem(cfg, split, i) for i in range(num_problems)]
    cats = np.concatenate([p.category for p in problems])
    dists, reused = [], {"keep": [], "let": []}
    for p in problems:
        lookup = np.flatnonzero((p.category == LOOKUP_NEAR) | (p.category == LOOKUP_FAR))
        dists.append(lookup - p.deps[lookup, 0])
        sources = set(p.deps[lookup, 0].tolist())
        for kind in reused:
            # a fact's first value: `NAME v` on a keep/let line that is not itself a lookup
            first = [t for t in np.flatnonzero(p.line_kind == LINE_KINDS.index(kind))
                     if t >= 1 and is_name(p.tokens[t - 1])
                     and p.category[t] in (OTHER, COMPUTE)]
            reused[kind] += [t in sources for t in first]
    dists = np.concatenate(dists)
    lengths = np.array([len(p) for p in problems])
    return {
        "length": cfg.length,
        "mean_length": float(lengths.mean()),
        "min_length": int(lengths.min()),
        "max_length": int(lengths.max()),
        "category_fraction": {name: float(np.mean(cats == i)) for i, name in enumerate(CATEGORIES)},
        "lookups_per_problem": len(dists) / num_problems,
        "lookup_distance_quantiles": {q: int(np.quantile(dists, q / 100)) for q in (10, 25, 50, 75, 90)}
        if len(dists) else {},
        "far_threshold": cfg.far_threshold,
        "reused_fraction": {kind: float(np.mean(v)) if v else float("nan") for kind, v in reused.items()},
    }
