"""RULER-style long-context problems, generated offline and seeded, sized in real tokens.

Every task follows RULER's definition (Hsieh et al., 2024, "RULER: What's the real context
size of your long-context language models?"), rebuilt from its description:

=================  =========================================================================
``niah_noise``     one needle ("One of the special magic numbers for {key} is: {value}.") in a
                   haystack of repeated filler sentences; answer: the value
``niah_text``      the same needle in natural text (the Python docs, ``pydoc_data.topics``)
``niah_multikey``  four needles with different keys; one is asked
``niah_multivalue`` four needles with the same key; all four values are asked
``niah_multiquery`` four needles with different keys; two are asked
``vt``             variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... spread
                   through filler (plus a distractor chain); answer: every name holding the value
``cwe``            common-word extraction: a numbered word list where ten words occur often and
                   the rest rarely; answer: the ten common words
``fwe``            frequent-word extraction: coded words with Zipf frequencies; answer: the top 3
``qa``             question over passage: synthetic biographies (one asked, the rest distractors)
=================  =========================================================================

A :class:`Problem` keeps the context and the question apart (``context`` / ``question``) so
that a prefill-compression run can compress the cache after the context alone
(question-agnostic) or after both (question-aware); :func:`prompt_ids` builds the tokens.
Needle depths cycle through :data:`DEPTHS` with the problem index and are recorded.
Scores follow RULER: ``all`` = the fraction of reference strings found in the answer,
``any`` = 1 if one is (``qa``).
"""

from __future__ import annotations

import collections
import functools
import re
import zlib
from dataclasses import dataclass, field

import numpy as np

TASKS = ("niah_noise", "niah_text", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa")
DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)
GENERATOR_VERSION = "tasks-v1"     # bump when a change alters the problems
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class Problem:
    task: str
    index: int
    length: int                    # the target prompt length in tokens (the real prompt: 90-100% of it)
    depth: float | None            # relative depth of the first asked needle (its first value), if any
    context: str                   # instructions + the long text (what question-agnostic compression sees)
    question: str                  # the question, after the context
    answer_prefix: str             # the start of the assistant's answer (RULER gives it in the prompt)
    answers: tuple[str, ...]       # reference strings
    metric: str = "all"            # all | any
    meta: dict = field(default_factory=dict)


def score(problem: Problem, text: str) -> float:
    """RULER's string match: ``all`` = share of references in ``text``, ``any`` = one of them."""
    text = text.lower()
    hits = [a.lower() in text for a in problem.answers]
    return float(np.mean(hits)) if problem.metric == "all" else float(any(hits))


@functools.lru_cache(maxsize=1)
def _doc_text() -> tuple[str, ...]:
    """The Python reference topics as paragraphs (natural text shipped with CPython)."""
    import pydoc_data.topics as topics

    paras = []
    for k in sorted(topics.topics):
        for p in topics.topics[k].split("\n\n"):
            p = " ".join(p.split())
            if len(p) > 80 and not p.startswith((">>>", "...")):
                paras.append(p)
    return tuple(paras)


@functools.lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    """Plain lowercase words (4-9 letters) of the same text: keys, list words, names' parts."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,9}\b", " ".join(_doc_text())))))


def _sentences(start: int, n_paragraphs: int = 400) -> list[str]:
    """Sentences of the docs from paragraph ``start`` on (fine units: a needle's depth is exact)."""
    paras = _doc_text()
    out = []
    for i in range(n_paragraphs):
        for sent in re.split(r"(?<=[.!?])\s+", paras[(start + i) % len(paras)]):
            words = sent.split(" ")               # long "sentences" (tables, grammar) in pieces
            out += [" ".join(words[j : j + 30]) for j in range(0, len(words), 30)]
    return out


class _Counter:
    """Token counts of text pieces with the real tokenizer (cached: filler repeats a lot)."""

    def __init__(self, tok):
        self.tok = tok
        self.n = functools.lru_cache(maxsize=100_000)(lambda s: len(tok(s, add_special_tokens=False)["input_ids"]))


def _fill(counter: _Counter, units, budget: int) -> list[str]:
    """As many ``units`` (cycled) as fit in ``budget`` tokens."""
    out, used, i = [], 0, 0
    while True:
        u = units[i % len(units)]
        c = counter.n(u) + 1
        if used + c > budget:
            return out
        out.append(u)
        used += c
        i += 1


def _longest(fits, hi: int) -> int:
    """The largest ``m <= hi`` with ``fits(m)`` (``fits`` monotone; 0 if none)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _insert(counter: _Counter, units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """``units`` with each needle inserted where the tokens before it are ``depth`` of the total."""
    cum = np.cumsum([counter.n(u) + 1 for u in units])
    out = list(units)
    for needle, d in sorted(zip(needles, depths), key=lambda x: -x[1]):
        out.insert(int(np.searchsorted(cum, d * cum[-1], side="right")) if len(units) else 0, needle)
    return out


def _number(rs, digits: int) -> str:
    return str(rs.randint(10 ** (digits - 1), 10 ** digits))


def _key(rs, words) -> str:
    return f"{words[rs.randint(len(words))]}-{words[rs.randint(len(words))]}"


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


class Generator:
    """``Generator(tokenizer).problem(task, length, index, seed)`` builds one :class:`Problem`;
    the same arguments give the same problem."""

    def __init__(self, tokenizer, *, digits: int = 6, chat_overhead: int = 40):
        self.count = _Counter(tokenizer)
        self.digits, self.overhead = digits, chat_overhead

    def fingerprint(self) -> dict:
        """What the problems depend on besides (task, length, index, seed)."""
        import hashlib

        return {"version": GENERATOR_VERSION, "digits": self.digits, "overhead": self.overhead,
                "question_aware": False,    # no problem restates its question (keeps stored fingerprints)
                "docs": hashlib.sha256("\n".join(_doc_text()).encode()).hexdigest()[:16]}

    def problem(self, task: str, length: int, index: int, seed: int = 0) -> Problem:
        if task not in TASKS:
            raise ValueError(f"unknown long-context task {task!r}; known: {', '.join(TASKS)}")
        if length < 256:
            raise ValueError(f"length {length} is too short for a long-context problem (at least 256 tokens)")
        rs = np.random.RandomState([seed, zlib.crc32(task.encode()), length, index])
        depth = DEPTHS[index % len(DEPTHS)]
        return getattr(self, "_" + task)(rs, task, length, index, depth)

    def problems(self, task: str, length: int, n: int, seed: int = 0) -> list[Problem]:
        return [self.problem(task, length, i, seed) for i in range(n)]

    # -- the context budget: target minus instructions, question and chat template --------
    def _room(self, length: int, *texts: str, question: str = "") -> int:
        return length - self.overhead - sum(self.count.n(t) for t in (*texts, question))

    def _niah(self, rs, task, length, index, depth, *, haystack, n_keys, n_values, n_asked):
        words = _words()
        keys = []
        while len(keys) < n_keys:
            k = _key(rs, words)
            if k not in keys:
                keys.append(k)
        needles, values = [], {}
        for k in keys:
            values[k] = [_number(rs, self.digits) for _ in range(n_values)]
            needles += [_needle(k, v) for v in values[k]]
        asked = keys[:n_asked]
        order = rs.permutation(len(needles))
        needles = [needles[i] for i in order]
        depths = [depth] + [float(rs.uniform(0.02, 0.98)) for _ in needles[1:]]
        # the first asked key's first value sits at the recorded depth
        first = needles.index(_needle(asked[0], values[asked[0]][0]))
        needles.insert(0, needles.pop(first))
        what = "numbers" if n_values > 1 or n_asked > 1 else "number"
        ask = ", ".join(asked)
        intro = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                 "I will quiz you about the numbers afterwards.")
        question = (f"What are all the special magic numbers for {ask} mentioned in the provided text?"
                    if what == "numbers" else f"What is the special magic number for {ask} mentioned in the "
                                              "provided text?")
        prefix = (f"The special magic {what} for {ask} mentioned in the provided text {'are' if what == 'numbers' else 'is'}")
        units = [NOISE] if haystack == "noise" else _sentences(rs.randint(len(_doc_text())))
        room = self._room(length, intro, prefix, *needles, question=question)
        context = " ".join(_insert(self.count, _fill(self.count, units, room), needles, depths))
        answers = tuple(v for k in asked for v in values[k])
        return Problem(task, index, length, depth, f"{intro}\n\n{context}", question, prefix, answers,
                       meta={"keys": keys, "asked": asked})

    def _niah_noise(self, rs, task, length, index, depth):
        return self._niah(rs, task, length, index, depth, haystack="noise", n_keys=1, n_values=1, n_asked=1)

    def _niah_text(self, rs, task, length, index, depth):
        return self._niah(rs, task, length, index, depth, haystack="text", n_keys=1, n_values=1, n_asked=1)

    def _niah_multikey(self, rs, task, length, index, depth):
        return self._niah(rs, task, length, index, depth, haystack="noise", n_keys=4, n_values=1, n_asked=1)

    def _niah_multivalue(self, rs, task, length, index, depth):
        return self._niah(rs, task, length, index, depth, haystack="noise", n_keys=1, n_values=4, n_asked=1)

    def _niah_multiquery(self, rs, task, length, index, depth):
        return self._niah(rs, task, length, index, depth, haystack="noise", n_keys=4, n_values=1, n_asked=2)

    def _vt(self, rs, task, length, index, depth, hops: int = 4):
        def names(n):
            out = set()
            while len(out) < n:
                out.add("".join(chr(65 + c) for c in rs.randint(0, 26, 5)))
            return sorted(out)

        all_names = names(2 * (hops + 1))
        rs.shuffle(all_names)
        chains = [all_names[: hops + 1], all_names[hops + 1:]]
        value, other = _number(rs, 5), _number(rs, 5)
        while other == value:
            other = _number(rs, 5)
        lines = []
        for chain, v in ((chains[0], value), (chains[1], other)):
            lines.append([f"VAR {chain[0]} = {v}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])])
        # the asked chain's statements in order, starting at the recorded depth; the distractor anywhere
        depths = sorted([depth] + [float(rs.uniform(depth, 0.98)) for _ in range(hops)])
        needles = lines[0] + lines[1]
        depths += sorted(float(rs.uniform(0.02, 0.98)) for _ in range(hops + 1))
        intro = "Memorize and track the chain(s) of variable assignment hidden in the following text."
        question = f"Find all variables that are assigned the value {value} in the text above."
        prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
                  f"variables are assigned the value {value}, they are:")
        room = self._room(length, intro, prefix, *needles, question=question)
        context = " ".join(_insert(self.count, _fill(self.count, [NOISE], room), needles, depths))
        return Problem(task, index, length, depth, f"{intro}\n\n{context}", question, prefix, tuple(chains[0]),
                       meta={"value": value, "distractor": chains[1]})

    def _cwe(self, rs, task, length, index, depth, n_common: int = 10, common_freq: int = 30, rare_freq: int = 3):
        intro = "Below is a numbered list of words. In these words, some appear more often than others."
        question = f"What are the {n_common} most common words in the above list?"
        prefix = f"Answer: The top {n_common} words that appear most often in the list are:"
        # no list word inside the instructions (the string match would find it there)
        said = " ".join((intro, question, prefix)).lower()
        words = [str(w) for w in rs.permutation(_words()) if w not in said]
        common = words[:n_common]
        room = self._room(length, intro, prefix, question=question)
        # shrink the common-word frequency on short lists so that the rare words still fit
        per_item = 4
        slots = room // per_item
        freq = max(4, min(common_freq, (slots // 2) // n_common))
        n_rare = max(0, (slots - freq * n_common) // rare_freq)
        common = [str(w) for w in common]
        items = common * freq + words[n_common : n_common + n_rare] * rare_freq
        rs.shuffle(items)
        render = lambda m: " ".join(f"{i + 1}. {w}" for i, w in enumerate(items[:m]))   # noqa: E731
        text = render(_longest(lambda m: self.count.n(render(m)) <= room, len(items)))
        kept = collections.Counter(text.split()[1::2])
        if min(kept[w] for w in common) <= max((c for w, c in kept.items() if w not in common), default=0):
            raise RuntimeError(f"cwe: a {length}-token list cannot keep the common words apart; raise the length")
        return Problem(task, index, length, None, f"{intro}\n\n{text}", question, prefix, tuple(common),
                       meta={"common_freq": freq})

    def _fwe(self, rs, task, length, index, depth, alpha: float = 2.0, top: int = 3):
        vocab = set()
        while len(vocab) < 400:
            vocab.add("".join(chr(97 + c) for c in rs.randint(0, 26, 5)))
        vocab = [str(w) for w in rs.permutation(sorted(vocab))]
        intro = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                 "frequently appeared coded words.")
        question = "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?"
        prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
        room = self._room(length, intro, prefix, question=question)
        ranks = np.arange(1, len(vocab) + 1, dtype=float)
        p = ranks ** -alpha / np.sum(ranks ** -alpha)
        for _attempt in range(50):       # redraw until the top words are set apart from the rest
            draws = rs.choice(len(vocab), size=room, p=p)     # each word is at least one token
            render = lambda m: " ".join(vocab[i] for i in draws[:m]) + " ...."   # noqa: E731
            m = _longest(lambda m: self.count.n(render(m)) <= room, len(draws))
            text, draws = render(m), draws[:m]
            counts = np.bincount(draws, minlength=len(vocab))
            ordered = np.sort(counts)[::-1]
            if ordered[top - 1] > ordered[top]:
                break
        else:
            raise RuntimeError(f"fwe: no {length}-token text with a unique top {top} in 50 draws; raise the length")
        best = [vocab[i] for i in np.argsort(-counts, kind="stable")[:top]]
        return Problem(task, index, length, None, f"{intro}\n\n{text}", question, prefix, tuple(best),
                       meta={"counts": sorted(counts.tolist(), reverse=True)[:top + 2]})

    def _qa(self, rs, task, length, index, depth):
        words = _words()
        jobs = ["lighthouse keeper", "clockmaker", "botanist", "ferry captain", "glassblower", "cartographer",
                "beekeeper", "bookbinder", "astronomer", "stonemason", "violin maker", "weaver"]

        def person():
            first = words[rs.randint(len(words))].capitalize()
            last = words[rs.randint(len(words))].capitalize() + "son"
            town = words[rs.randint(len(words))].capitalize() + "ford"
            return {"name": f"{first} {last}", "town": town, "year": str(rs.randint(1700, 1950)),
                    "job": jobs[rs.randint(len(jobs))]}

        def bio(i, p):
            return (f"Document {i}: {p['name']} was born in {p['town']} in {p['year']} and worked for most of "
                    f"their life as a {p['job']}. Neighbours remembered {p['name']} as patient and exact.")

        asked = person()
        kind = ["town", "year", "job"][index % 3]
        q = {"town": f"In which town was {asked['name']} born?", "year": f"In which year was {asked['name']} born?",
             "job": f"What did {asked['name']} work as?"}[kind]
        intro = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
        question = f"Answer the question based on the given documents. Question: {q}"
        # the answer's start names the person (a 135M model answers nothing to a bare "Answer:")
        prefix = {"town": f"Answer: {asked['name']} was born in the town of",
                  "year": f"Answer: {asked['name']} was born in the year",
                  "job": f"Answer: {asked['name']} worked as a"}[kind]
        room = self._room(length, intro, prefix, question=question)
        docs, used = [], 0
        while True:
            b = bio(len(docs) + 1, person())
            c = self.count.n(b) + 1
            if used + c > room - self.count.n(bio(0, asked)) - 1:
                break
            docs.append(b)
            used += c
        at = int(round(depth * len(docs)))
        docs.insert(at, bio(0, asked))
        docs = [re.sub(r"^Document \d+:", f"Document {i + 1}:", d) for i, d in enumerate(docs)]
        return Problem(task, index, length, depth, f"{intro}\n\n" + "\n".join(docs), question, prefix,
                       (asked[kind],), metric="any", meta={"asked": kind, "documents": len(docs)})


def prompt_ids(tokenizer, problem: Problem, *, question_aware: bool = False) -> tuple[list[int], list[int]]:
    """``(context ids, question ids)`` of the chat prompt (system/user/assistant template, the
    answer prefix after the assistant header). Their concatenation is the whole prompt's
    tokenization, and the same for both splits; a prefill-compressing policy compresses the first part.

    question-agnostic (default): the first part ends with the context; the question comes after
    what is compressed. ``question_aware`` (kvpress's question-aware setting): the first part
    ends with the question, so the question is compressed with the context and an observation
    window (SnapKV's) reads it; the second part is the chat template's end and the answer prefix."""
    marker = "\u2063QUESTION\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{problem.context}{marker}"}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = text.split(marker)
    # the split sits before the blank line, or before the template's special end token, so both
    # halves tokenize as the whole text does
    question = f"\n\n{problem.question}"
    head, tail = (head + question, tail) if question_aware else (head, question + tail)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    return enc(head), enc(tail + problem.answer_prefix)
