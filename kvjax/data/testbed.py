"""Seeded generator of synthetic reasoning-trace problems (the testbed task).

A problem is a word-level trace whose memory demands mimic math reasoning:

    <bos> facts : keep a3 = 7 ; let q0 = 2 ; ... trace :            <- prompt
    work 4 + 5 -> 9 - 3 -> 6 ;                                     <- scratch (local)
    keep a3 = 7 + 2 -> m1 = 9 ;                                    <- reuse a3, bind m1
    let 3 * 4 -> c2 = 2 ;   keep k5 = 1 ;   use m1 = 9 - 5 -> 4 ;  <- facts, reuse
    ...
    query m1 + a3 - k5 ; answer m1 = 9 -> 9 + a3 = 7 -> 6 - k5 = 1 -> 5 ; <eos>

* Facts (`NAME = value`) are bound by definitions in the prompt and in the
  trace, and by derived lines (`... -> NAME = value`). Names never rebind, so a
  later `NAME =` is followed by a copy of the value: a lookup, graded
  `lookup_near` or `lookup_far` by its distance to the nearest earlier
  occurrence of that value (`far` when the distance exceeds
  `far_frac * length`).
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
  starts at `answer_start`, right after the word `answer`.

Every problem fits in `length` tokens (the last lines are trimmed scratch), and
its randomness comes from `SeedSequence([seed, split, index])`, so splits are
disjoint streams and a (config, split, index) triple always gives one problem.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

import numpy as np

from kvjax.data.vocab import BOS_ID, EOS_ID, MAX_NAMES, MAX_VALUES, OPERATORS, PAD_ID, decode, name_id, number_id, tok

OTHER, LOOKUP_NEAR, LOOKUP_FAR, COMPUTE = 0, 1, 2, 3
CATEGORIES = ("other", "lookup_near", "lookup_far", "compute")
LINE_KINDS = ("header", "keep", "let", "use", "work", "answer")
SPLITS = ("train", "valid", "test")

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_DERIVED_LEN = 13  # `keep n = v + n = v -> n = v ;`, the longest non-scratch line


def apply_op(op: str, a: int, b: int, num_values: int) -> int:
    """`a op b` modulo `num_values`."""
    return _OPS[op](a, b) % num_values


def _scratch_len(steps: int) -> int:
    return 3 + 4 * steps  # `work v (op v -> r)*steps ;`


def _answer_len(terms: int) -> int:
    query = 2 * terms + 1  # `query n (op n)* ;`
    answer = 1 + 5 * terms + (terms - 1) + 2  # `answer n = v -> r (op n = v -> r)* ; <eos>`
    return query + answer


@dataclass(frozen=True)
class TestbedConfig:
    """All knobs of the generator; a bad value raises ValueError naming its field.

    `length` is the token budget of a problem (lengths fall in
    `[length - 6, length]`); scaling it scales the number of lines and every
    delay. Curriculum knobs: `num_names` (names drawn from the first
    `num_names` of the vocabulary), `num_defs` (prompt definitions),
    `num_values`, `length`, `far_prob`.
    """

    __test__ = False  # keeps pytest from collecting this class by its name

    length: int = 1024
    num_names: int = MAX_NAMES
    num_defs: int = 6
    num_values: int = 10
    ops: tuple[str, ...] = ("+", "-")
    scratch_prob: float = 0.5  # a free line slot is scratch work (else a new fact)
    scratch_steps: tuple[int, int] = (2, 6)  # operations per scratch line, inclusive
    def_prob: float = 0.4  # a new fact is a literal definition (else derived)
    keep_prob: float = 0.5  # a new fact is marked `keep` (else `let`)
    keep_reuse: float = 0.8
    let_reuse: float = 0.15
    reuse_again: float = 0.6
    bind_prob: float = 0.6  # a line that references a fact binds a new one (else `use`)
    min_delay: int = 8
    far_prob: float = 0.5
    far_frac: float = 0.25
    answer_terms: tuple[int, int] = (2, 4)  # inclusive range
    seed: int = 0

    def __post_init__(self):
        for name in ("ops", "scratch_steps", "answer_terms"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("length", "num_names", "num_defs", "num_values", "min_delay", "seed"):
            _check(isinstance(getattr(self, name), int), name, "must be an int")
        _check(0 < self.far_frac < 1, "far_frac", "must be in (0, 1)")
        for name in ("scratch_prob", "def_prob", "keep_prob", "keep_reuse", "let_reuse", "reuse_again",
                     "bind_prob", "far_prob"):
            _check(0.0 <= getattr(self, name) <= 1.0, name, "must be a probability in [0, 1]")
        _check(2 <= self.num_values <= MAX_VALUES, "num_values", f"must be in 2..{MAX_VALUES}")
        _check(len(self.ops) > 0 and set(self.ops) <= set(OPERATORS) and len(set(self.ops)) == len(self.ops),
               "ops", f"must be distinct operators from {OPERATORS}")
        _check(_is_range(self.scratch_steps, 1), "scratch_steps", "must be (lo, hi) with 1 <= lo <= hi")
        _check(_is_range(self.answer_terms, 2), "answer_terms", "must be (lo, hi) with 2 <= lo <= hi")
        _check(self.answer_terms[1] <= self.num_defs, "num_defs", "must be >= answer_terms[1]")
        _check(self.num_defs <= self.num_names <= MAX_NAMES, "num_names", f"must be in num_defs..{MAX_NAMES}")
        _check(0 <= self.seed < 2**32, "seed", "must be in 0..2**32-1")
        _check(self.length >= self.min_length, "length", f"must be >= {self.min_length} for these knobs")
        _check(1 <= self.min_delay < self.far_threshold, "min_delay", "must be in 1..far_frac*length-1")

    @property
    def far_threshold(self) -> int:
        """A lookup is `lookup_far` when it copies a value more than this many tokens back."""
        return int(self.far_frac * self.length)

    @property
    def prompt_length(self) -> int:
        return 3 + 5 * self.num_defs + 2  # `<bos> facts :` defs `trace :`

    @property
    def min_length(self) -> int:
        """Smallest `length` that fits the prompt, a few lines and the longest answer."""
        return self.prompt_length + 4 * _DERIVED_LEN + _answer_len(self.answer_terms[1])

    def scaled(self, factor: int) -> TestbedConfig:
        """The same task with `factor` times the length (evaluation at 2x, 4x)."""
        return dataclasses.replace(self, length=self.length * factor)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"TestbedConfig.{field} {message}")


def _is_range(pair: tuple, lowest: int) -> bool:
    return len(pair) == 2 and all(isinstance(v, int) for v in pair) and lowest <= pair[0] <= pair[1]


@dataclass(frozen=True)
class Problem:
    """One generated problem; all arrays are aligned on token positions `[n]`.

    tokens:       int32, starts with `<bos>`, ends with `<eos>`.
    category:     int8 index into `CATEGORIES` (graded tokens are not `other`).
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
        """`NAME = value`, the value copied from its latest occurrence."""
        fact = self.facts[name]
        self.emit(name_id(name))
        self.words("=")
        far = self.pos - fact.pos > self.cfg.far_threshold
        fact.pos = self.emit(number_id(fact.value), LOOKUP_FAR if far else LOOKUP_NEAR, (fact.pos, -1))
        if reschedule:
            self.schedule(name, self.cfg.reuse_again)
        return fact.pos, fact.value

    def marker(self) -> str:
        return "keep" if self.rng.random() < self.cfg.keep_prob else "let"

    # ---- lines ------------------------------------------------------------
    def definition(self) -> None:
        """`keep NAME = v ;` with a free value."""
        kind, name = self.marker(), self.free_names.pop()
        self.start_line(kind)
        self.emit(name_id(name))
        self.words("=")
        pos, value = self.literal()
        self.words(";")
        self.add_fact(name, kind, pos, value)

    def derived(self, refs: list[int], bind: bool) -> None:
        """`keep x = 3 + 2 -> NAME = 5 ;` (binds) or `use x = 3 + 2 -> 5 ;`."""
        kind = self.marker() if bind else "use"
        self.start_line(kind)
        operands = refs + [-1] * (2 - len(refs))
        self.rng.shuffle(operands)
        a = self.lookup(operands[0], True) if operands[0] >= 0 else self.literal()
        op = self.operator()
        b = self.lookup(operands[1], True) if operands[1] >= 0 else self.literal()
        self.words("->")
        if bind:
            name = self.free_names.pop()
            self.emit(name_id(name))
            self.words("=")
        result = self.compute(op, a, b)
        self.words(";")
        if bind:
            self.add_fact(name, kind, *result)

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
        far = [n for n, f in self.facts.items() if self.pos - f.pos > self.cfg.far_threshold]
        near = sorted((n for n in self.facts if n not in far), key=lambda n: self.facts[n].pos)
        if len(far) <= terms:
            return far + near[: terms - len(far)]
        keep = LINE_KINDS.index("keep")
        weights = np.array([(self.cfg.keep_reuse if self.facts[n].kind == keep else self.cfg.let_reuse) + 0.01
                            for n in far])
        chosen = self.rng.choice(len(far), size=terms, replace=False, p=weights / weights.sum())
        return [far[i] for i in chosen]

    def answer(self, terms: int) -> tuple[int, int, int]:
        """`query n1 op2 n2 ... ; answer n1 = v1 -> v1 op2 n2 = v2 -> r2 ... ; <eos>`.

        Every term has the same shape `NAME = v -> running`, so the copies
        from the query sit at fixed offsets: the next operator follows the
        name four tokens back, the next name follows it in the query.
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
                self.emit(tok(ops[i - 1]), OTHER, (query[2 * i - 1], -1))
            value = self.lookup(name, reschedule=False)
            self.deps[value[0] - 2] = (query[2 * i], -1)  # the name is a copy from the query
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
    end = cfg.length - _answer_len(terms)  # the trace must stop here
    b = _Builder(cfg, rng, end)
    b.emit(BOS_ID)
    b.words("facts", ":")
    for _ in range(cfg.num_defs):
        b.definition()
    b.start_line("header")
    b.words("trace", ":")
    prompt_len = b.pos
    longest = max(_scratch_len(cfg.scratch_steps[1]), _DERIVED_LEN)
    while b.pos + longest <= end:
        refs = b.pop_due(2)
        if refs:
            b.derived(refs, bind=bool(b.free_names) and rng.random() < cfg.bind_prob)
        elif not b.free_names or rng.random() < cfg.scratch_prob:
            b.scratch(_steps(rng, cfg, cfg.scratch_steps[1]))
        elif rng.random() < cfg.def_prob:
            b.definition()
        else:
            b.derived([], bind=True)
    while end - b.pos >= _scratch_len(1):  # fill the remainder with shorter scratch lines
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
