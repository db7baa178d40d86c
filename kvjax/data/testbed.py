"""Seeded generator of synthetic reasoning-trace problems (the testbed task).

A problem is a word-level trace whose memory demands mimic math reasoning:

    <bos> facts : keep a3 7 ; let q0 2 ; ... trace :            <- prompt
    work 4 + 5 -> 9 - 3 -> 6 ;                                 <- scratch (local)
    keep a3 7 + 2 -> 9 m1 9 ;                                  <- reuse a3, bind m1
    let 3 * 4 -> 2 c2 2 ;   keep k5 1 ;   use m1 9 - 5 -> 4 ;  <- facts, reuse
    ...
    query m1 + a3 - k5 ; answer m1 9 -> 9 + a3 7 -> 6 - k5 1 -> 5 ; <eos>

* Facts (`NAME value`) are bound by definitions in the prompt and in the
  trace, and by derived lines (`... -> r NAME r`). Names never rebind, so a
  later `NAME` is followed by a copy of its value: a lookup, graded
  `lookup_near` or `lookup_far` by its distance to the nearest earlier
  occurrence of that value (`far` when the distance exceeds
  `far_frac * length`). The value follows its name directly (no `=` between):
  a lookup is then the plain induction copy "after this token came that one",
  which a 2-layer model learns in ~150 steps, where `NAME = value` (the value
  two tokens after the name) left the lookups at chance for 600+ steps.
* A derived line computes its result right after `->` and then binds it,
  `-> r NAME r`: the bound value is a copy of the token two back. Written
  `-> NAME r`, the result had to be computed at the (unpredictable) name, one
  step removed from its operands, and the 2-layer teacher stayed at chance
  (10%) on exactly those results while reaching 100% on every other one.
* The marker predicts reuse: a `keep` fact is scheduled for a later reference
  with probability `keep_reuse` (0.8), a `let` fact with `let_reuse` (0.15);
  `work` scratch lines and `use` lines bind nothing and are never referenced.
  Each reference is rescheduled with probability `reuse_again`. Delays are a
  mixture: with probability `far_prob` uniform in (far threshold, room),
  otherwise log-uniform in [min_delay, min(far threshold, room)], where `room`
  is what is left of the trace (so planned reuses are realised), and the far
  threshold is `far_frac * length`, so delays scale with `length`.
* Arithmetic is one binary operation mod `num_values` on single-token numbers
  (`a OP b -> c`); the result is graded `compute`, its operands are recorded in
  `deps` and the operator token always sits at `deps[0] + 1`.
* The answer combines 2-4 facts picked at the end (far ones first, weighted by
  their marker's reuse probability): `query` names them, the `answer` line
  looks each up and folds them left to right. Generation for the answer check
  starts at `answer_start`, right after the word `answer`. The answer line's
  names and operators are copies from the query line, categories `copy_name`
  and `copy_op` (graded on their own, outside the `graded` pool of lookups and
  computation).

Every problem fits in `length` tokens (the last lines are trimmed scratch), and
its randomness comes from `SeedSequence([seed, split, index])`, so splits are
disjoint streams and a (config, split, index) triple always gives one problem.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from kvjax.data.config import DERIVED_LEN, TestbedConfig, answer_len, scratch_len
from kvjax.data.vocab import BOS_ID, EOS_ID, decode, name_id, number_id, tok

OTHER, LOOKUP_NEAR, LOOKUP_FAR, COMPUTE, COPY_NAME, COPY_OP = 0, 1, 2, 3, 4, 5
CATEGORIES = ("other", "lookup_near", "lookup_far", "compute", "copy_name", "copy_op")
LINE_KINDS = ("header", "keep", "let", "use", "work", "answer")
SPLITS = ("train", "valid", "test")

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def apply_op(op: str, a: int, b: int, num_values: int) -> int:
    """`a op b` modulo `num_values`."""
    return _OPS[op](a, b) % num_values


@dataclass(frozen=True)
class Problem:
    """One generated problem; all arrays are aligned on token positions `[n]`.

    tokens:       int32, starts with `<bos>`, ends with `<eos>`.
    category:     int8 index into `CATEGORIES` (`other`: not graded).
    deps:         int32 `[n, 2]`, the positions a token is computed from
                  (a lookup: `[source, -1]`; a compute: its two operands;
                  the answer's copies of query words and its first running
                  value: `[source, -1]`; else -1).
    line_kind:    int8 index into `LINE_KINDS` of the line holding the token.
    prompt_len:   the trace starts at this position.
    answer_start: first position the model generates in the answer check.
    answer_pos:   position of the final answer value (the token before `;`).
    answer:       the answer value.
    """

    tokens: np.ndarray
    category: np.ndarray
    deps: np.ndarray
    line_kind: np.ndarray
    prompt_len: int
    answer_start: int
    answer_pos: int
    answer: int

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def text(self) -> str:
        return decode(self.tokens)

    @property
    def last_use(self) -> np.ndarray:
        """int32 `[n]`: the last position computed from each token, -1 if none (the oracle's view)."""
        last = np.full(len(self.tokens), -1, np.int32)
        pos = np.repeat(np.arange(len(self.tokens), dtype=np.int32), 2)
        src = self.deps.reshape(-1)
        np.maximum.at(last, src[src >= 0], pos[src >= 0])
        return last


@dataclass
class _Fact:
    kind: int  # index into LINE_KINDS: keep or let
    value: int
    pos: int  # position of the most recent occurrence of the value


class _Builder:
    """Appends lines to one problem while keeping facts and the reuse schedule."""

    def __init__(self, cfg: TestbedConfig, rng: np.random.Generator, end: int):
        self.cfg, self.rng, self.end = cfg, rng, end
        self.ids: list[int] = []
        self.cat: list[int] = []
        self.deps: list[tuple[int, int]] = []
        self.kind: list[int] = []
        self.line_kind = 0
        self.free_names = [int(i) for i in rng.permutation(cfg.num_names)]
        self.facts: dict[int, _Fact] = {}
        self.due: list[tuple[int, int, int]] = []  # heap of (due position, tie-break, name)

    @property
    def pos(self) -> int:
        return len(self.ids)

    def emit(self, token_id: int, category: int = OTHER, deps: tuple[int, int] = (-1, -1)) -> int:
        self.ids.append(token_id)
        self.cat.append(category)
        self.deps.append(deps)
        self.kind.append(self.line_kind)
        return self.pos - 1

    def words(self, *words: str) -> None:
        for word in words:
            self.emit(tok(word))

    def start_line(self, kind: str) -> None:
        self.line_kind = LINE_KINDS.index(kind)
        if kind in ("keep", "let", "use", "work"):
            self.words(kind)

    # ---- scheduling -------------------------------------------------------
    def schedule(self, name: int, prob: float) -> None:
        if self.rng.random() >= prob:
            return
        cfg, far, room = self.cfg, self.cfg.far_threshold, self.end - self.pos
        if room <= cfg.min_delay:
            return
        if self.rng.random() < cfg.far_prob and room > far + 1:
            delay = int(self.rng.integers(far + 1, room))
        else:
            delay = round(math.exp(self.rng.uniform(math.log(cfg.min_delay), math.log(min(far, room)))))
        heapq.heappush(self.due, (self.pos + delay, int(self.rng.integers(2**31)), name))

    def pop_due(self, limit: int) -> list[int]:
        names = []
        while self.due and self.due[0][0] <= self.pos and len(names) < limit:
            names.append(heapq.heappop(self.due)[2])
        return names

    def add_fact(self, name: int, kind: str, pos: int, value: int) -> None:
        self.facts[name] = _Fact(LINE_KINDS.index(kind), value, pos)
        self.schedule(name, self.cfg.keep_reuse if kind == "keep" else self.cfg.let_reuse)

    # ---- pieces -----------------------------------------------------------
    def literal(self) -> tuple[int, int]:
        value = int(self.rng.integers(self.cfg.num_values))
        return self.emit(number_id(value)), value

    def operator(self) -> str:
        op = str(self.rng.choice(self.cfg.ops))
        self.emit(tok(op))
        return op

    def compute(self, op: str, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        value = apply_op(op, a[1], b[1], self.cfg.num_values)
        return self.emit(number_id(value), COMPUTE, (a[0], b[0])), value

    def lookup(self, name: int, reschedule: bool) -> tuple[int, int]:
        """`NAME value`, the value copied from its latest occurrence."""
        fact = self.facts[name]
        self.emit(name_id(name))
        far = self.pos - fact.pos > self.cfg.far_threshold
        fact.pos = self.emit(number_id(fact.value), LOOKUP_FAR if far else LOOKUP_NEAR, (fact.pos, -1))
        if reschedule:
            self.schedule(name, self.cfg.reuse_again)
        return fact.pos, fact.value

    def marker(self) -> str:
        return "keep" if self.rng.random() < self.cfg.keep_prob else "let"

    # ---- lines ------------------------------------------------------------
    def definition(self) -> None:
        """`keep NAME v ;` with a free value."""
        kind, name = self.marker(), self.free_names.pop()
        self.start_line(kind)
        self.emit(name_id(name))
        pos, value = self.literal()
        self.words(";")
        self.add_fact(name, kind, pos, value)

    def derived(self, refs: list[int], bind: bool) -> None:
        """`keep x 3 + 2 -> 5 NAME 5 ;` (binds) or `use x 3 + 2 -> 5 ;`."""
        kind = self.marker() if bind else "use"
        self.start_line(kind)
        operands = refs + [-1] * (2 - len(refs))
        self.rng.shuffle(operands)
        a = self.lookup(operands[0], True) if operands[0] >= 0 else self.literal()
        op = self.operator()
        b = self.lookup(operands[1], True) if operands[1] >= 0 else self.literal()
        self.words("->")
        result = self.compute(op, a, b)
        if bind:
            name = self.free_names.pop()
            self.emit(name_id(name))
            copy = self.emit(number_id(result[1]), OTHER, (result[0], -1))
            self.add_fact(name, kind, copy, result[1])
        self.words(";")

    def recall(self, name: int) -> None:
        """`use NAME v ;`: a lookup on its own (curriculum lines, ``recall_prob``)."""
        self.start_line("use")
        self.lookup(name, reschedule=False)
        self.words(";")

    def scratch(self, steps: int) -> None:
        """`work 4 + 5 -> 9 - 3 -> 6 ;`: each result is used only by the next step."""
        self.start_line("work")
        acc = self.literal()
        for _ in range(steps):
            op = self.operator()
            b = self.literal()
            self.words("->")
            acc = self.compute(op, acc, b)
        self.words(";")

    def pick_answer_facts(self, terms: int) -> list[int]:
        """`terms` facts, preferring far ones, weighted by their marker's reuse probability."""
        is_far = {n: self.pos - f.pos > self.cfg.far_threshold for n, f in self.facts.items()}
        far = [n for n in self.facts if is_far[n]]
        near = sorted((n for n in self.facts if not is_far[n]), key=lambda n: self.facts[n].pos)
        if len(far) <= terms:
            return far + near[: terms - len(far)]
        keep = LINE_KINDS.index("keep")
        weights = np.array([(self.cfg.keep_reuse if self.facts[n].kind == keep else self.cfg.let_reuse) + 0.01
                            for n in far])
        chosen = self.rng.choice(len(far), size=terms, replace=False, p=weights / weights.sum())
        return [far[i] for i in chosen]

    def answer(self, terms: int) -> tuple[int, int, int]:
        """`query n1 op2 n2 ... ; answer n1 v1 -> v1 op2 n2 v2 -> r2 ... ; <eos>`.

        Every term has the same shape `NAME v -> running`, so the copies
        from the query sit at fixed offsets: the next operator follows the
        name three tokens back, the next name follows it in the query.
        """
        names = self.pick_answer_facts(terms)
        ops = [str(op) for op in self.rng.choice(self.cfg.ops, size=terms - 1)]
        self.start_line("answer")
        self.words("query")
        query = []  # positions of n1, op2, n2, op3, n3, ...
        for i, name in enumerate(names):
            if i:
                query.append(self.emit(tok(ops[i - 1])))
            query.append(self.emit(name_id(name)))
        self.words(";", "answer")
        start = self.pos
        acc = None
        for i, name in enumerate(names):
            if i:
                self.emit(tok(ops[i - 1]), COPY_OP, (query[2 * i - 1], -1))
            value = self.lookup(name, reschedule=False)
            self.deps[value[0] - 1] = (query[2 * i], -1)  # the name is a copy from the query
            self.cat[value[0] - 1] = COPY_NAME
            self.words("->")
            if i:
                acc = self.compute(ops[i - 1], acc, value)
            else:
                acc = self.emit(number_id(value[1]), OTHER, (value[0], -1)), value[1]
        self.words(";")
        self.emit(EOS_ID)
        return start, acc[0], acc[1]


def _steps(rng: np.random.Generator, cfg: TestbedConfig, most: int) -> int:
    return min(int(rng.integers(cfg.scratch_steps[0], cfg.scratch_steps[1] + 1)), most)


def problem_rng(cfg: TestbedConfig, split: str, index: int) -> np.random.Generator:
    """The random stream of problem `index` of `split`: distinct triples give independent streams."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 <= index < 2**32:
        raise ValueError(f"index must be in 0..2**32-1, got {index}")
    return np.random.default_rng(np.random.SeedSequence([cfg.seed, SPLITS.index(split), index]))


def generate_problem(cfg: TestbedConfig, split: str, index: int) -> Problem:
    """Problem `index` of `split` (deterministic in `cfg`, `split`, `index`)."""
    rng = problem_rng(cfg, split, index)
    terms = int(rng.integers(cfg.answer_terms[0], cfg.answer_terms[1] + 1))
    end = cfg.length - answer_len(terms)  # the trace must stop here
    b = _Builder(cfg, rng, end)
    b.emit(BOS_ID)
    b.words("facts", ":")
    for _ in range(cfg.num_defs):
        b.definition()
    b.start_line("header")
    b.words("trace", ":")
    prompt_len = b.pos
    longest = max(scratch_len(cfg.scratch_steps[1]), DERIVED_LEN)
    while b.pos + longest <= end:
        refs = b.pop_due(2)
        if refs:
            b.derived(refs, bind=bool(b.free_names) and rng.random() < cfg.bind_prob)
        elif b.facts and cfg.recall_prob > 0 and rng.random() < cfg.recall_prob:
            b.recall(list(b.facts)[int(rng.integers(len(b.facts)))])
        elif not b.free_names or rng.random() < cfg.scratch_prob:
            b.scratch(_steps(rng, cfg, cfg.scratch_steps[1]))
        elif rng.random() < cfg.def_prob:
            b.definition()
        else:
            b.derived([], bind=True)
    while end - b.pos >= scratch_len(1):  # fill the remainder with shorter scratch lines
        b.scratch(_steps(rng, cfg, (end - b.pos - 3) // 4))
    answer_start, answer_pos, answer = b.answer(terms)
    return Problem(
        tokens=np.asarray(b.ids, np.int32),
        category=np.asarray(b.cat, np.int8),
        deps=np.asarray(b.deps, np.int32).reshape(-1, 2),
        line_kind=np.asarray(b.kind, np.int8),
        prompt_len=prompt_len,
        answer_start=answer_start,
        answer_pos=answer_pos,
        answer=answer,
    )
