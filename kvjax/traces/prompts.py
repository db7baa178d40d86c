"""Seeded, offline prompts for self-generated reasoning traces.

Three kinds, mixed in a fixed rotation, each a pure function of ``(seed, index)``:

- ``arithmetic``: multi-step word problems with random names, objects and numbers, asked
  to be solved step by step (the question's answer is computed and stored).
- ``reasoning``: multi-step questions — orderings from pairwise comparisons, chains of
  relative ages, schedules over days of the week — asked to be reasoned through.
- ``passage``: a passage of the Python language reference that ships with every Python
  (``pydoc_data.topics``), asked to be summarised or explained.

Each prompt carries follow-up user turns (more problems of its kind, or questions on the
same passage) so that a conversation can be continued until the trace is long enough.
"""

from __future__ import annotations

import dataclasses
import random
import re
from functools import lru_cache

KINDS = ("arithmetic", "reasoning", "passage")

NAMES = ["Alice", "Bob", "Carla", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam",
         "Maya", "Nikolai", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf"]
ITEMS = [("apple", "apples"), ("book", "books"), ("marble", "marbles"), ("pencil", "pencils"),
         ("sticker", "stickers"), ("cookie", "cookies"), ("stamp", "stamps"), ("shell", "shells"),
         ("card", "cards"), ("coin", "coins")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    messages: tuple[dict, ...]        # chat messages for the first turn
    followups: tuple[str, ...]        # further user turns, in order
    answer: str | None = None         # the first turn's answers (' | '-joined), where computed


def _word_problem(rng: random.Random) -> tuple[str, int]:
    name, other = rng.sample(NAMES, 2)
    one, many = rng.choice(ITEMS)
    a, bags, per, k = rng.randint(3, 40), rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 4)
    form = rng.randrange(4)
    if form == 0:
        total = a + bags * per
        give = total // k
        text = (f"{name} has {a} {many}. {name} buys {bags} boxes with {per} {many} in each box, then gives "
                f"{give} {many} to {other}. How many {many} does {name} have now?")
        return text, total - give
    if form == 1:
        price, budget = rng.randint(2, 9), rng.randint(50, 150)
        text = (f"A {one} costs {price} dollars. {name} has {budget} dollars and buys {bags} packs of {per} "
                f"{many}. How much money does {name} have left, and can {name} afford it?")
        return text, budget - price * bags * per
    if form == 2:
        days = rng.randint(3, 12)
        text = (f"{name} reads {per} pages on weekdays and {per + k} pages on weekend days. Starting on a "
                f"Monday, how many pages has {name} read after {days} days?")
        pages = sum(per + k if d % 7 >= 5 else per for d in range(days))
        return text, pages
    rows, cols, missing = rng.randint(3, 9), rng.randint(3, 9), rng.randint(1, 10)
    text = (f"{name} arranges {many} in {rows} rows of {cols}, but {missing} spots are empty. {other} adds "
            f"{a} more {many}. How many {many} are there in total?")
    return text, rows * cols - missing + a


def _reasoning(rng: random.Random) -> tuple[str, str]:
    form = rng.randrange(3)
    people = rng.sample(NAMES, rng.randint(4, 6))
    if form == 0:
        order = people[:]
        facts = [f"{order[i]} is taller than {order[i + 1]}." for i in range(len(order) - 1)]
        rng.shuffle(facts)
        text = " ".join(facts) + " Who is the shortest, and list everyone from tallest to shortest?"
        return text, ", ".join(order)
    if form == 1:
        base = rng.randint(8, 30)
        ages, facts = {people[0]: base}, [f"{people[0]} is {base} years old."]
        for prev, cur in zip(people, people[1:]):
            d = rng.randint(1, 9)
            older = rng.random() < 0.5 or ages[prev] - d < 4
            ages[cur] = ages[prev] + (d if older else -d)
            facts.append(f"{cur} is {d} years {'older' if older else 'younger'} than {prev}.")
        text = " ".join(facts) + f" How old is {people[-1]}? Explain each step."
        return text, str(ages[people[-1]])
    start, shifts = rng.randrange(7), [rng.randint(1, 20) for _ in range(3)]
    text = (f"A meeting is on {DAYS[start]}. It is moved {shifts[0]} days later, then {shifts[1]} days "
            f"earlier, then {shifts[2]} days later. On which day of the week is it now? Reason step by step.")
    return text, DAYS[(start + shifts[0] - shifts[1] + shifts[2]) % 7]


@lru_cache(maxsize=1)
def pydoc_passages(min_chars: int = 1200, max_chars: int = 3200) -> tuple[tuple[str, str], ...]:
    """``(topic, passage)`` windows of the Python language reference, cut at blank lines."""
    import pydoc_data.topics as topics

    out = []
    for topic in sorted(topics.topics):
        paras = [p for p in re.split(r"\n\s*\n", topics.topics[topic]) if p.strip()]
        buf = ""
        for para in paras:
            if buf and len(buf) + len(para) > max_chars:
                if len(buf) >= min_chars:
                    out.append((topic, buf.strip()))
                buf = ""
            buf += para[:max_chars] + "\n\n"
        if len(buf) >= min_chars:
            out.append((topic, buf.strip()))
    return tuple(out)


PASSAGE_ASKS = ["Summarise the passage above in your own words, step by step.",
                "Explain what the passage above describes, as if teaching a beginner. Give an example.",
                "List the main rules stated in the passage above and explain each one."]
PASSAGE_FOLLOWUPS = ["Which part of the passage is the most surprising, and why?",
                     "Write a short Python example that illustrates the passage, and explain it line by line.",
                     "What mistakes might a programmer make with this feature? Refer to the passage.",
                     "Summarise your explanation in three sentences."]


def prompt_id(index: int) -> str:
    return f"{KINDS[index % len(KINDS)]}-{index:06d}"


def make_prompt(seed: int, index: int) -> Prompt:
    """The ``index``-th prompt of the set seeded by ``seed`` (kinds rotate)."""
    rng = random.Random(f"kvjax-traces:{seed}:{index}")
    kind = KINDS[index % len(KINDS)]
    pid = prompt_id(index)
    if kind in ("arithmetic", "reasoning"):
        make = _word_problem if kind == "arithmetic" else _reasoning
        first = [make(rng) for _ in range(3)]
        ask = "Solve each of the following problems step by step."
        text = ask + "\n\n" + "\n\n".join(f"{n}. {q}" for n, (q, _) in enumerate(first, 1))
        more = tuple("Now solve these step by step too.\n\n" + "\n\n".join(
            f"{n}. {make(rng)[0]}" for n in (1, 2)) for _ in range(4))
        return Prompt(pid, kind, ({"role": "user", "content": text},), more, " | ".join(str(a) for _, a in first))
    passages = pydoc_passages()
    topic, passage = passages[rng.randrange(len(passages))]
    ask = rng.choice(PASSAGE_ASKS)
    more = tuple(rng.sample(PASSAGE_FOLLOWUPS, len(PASSAGE_FOLLOWUPS)))
    content = f"{passage}\n\n{ask}"
    return Prompt(pid, kind, ({"role": "user", "content": content},), more, None)
