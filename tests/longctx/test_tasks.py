"""RULER-style problems with the real tokenizer: seeded, sized, and each task's answer is right
by construction (parsed back out of the generated text)."""

import collections
import re

import pytest
import transformers

from kvjax.longctx.tasks import TASKS, Generator, Problem, prompt_ids, score
from kvjax.real_model import ensure_model


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(ensure_model())


@pytest.fixture(scope="module")
def gen(tok):
    return Generator(tok)


@pytest.mark.parametrize("length", [1024, 2048])
def test_every_task_is_seeded_and_sized(tok, gen, length):
    for task in TASKS:
        a, b, c = gen.problem(task, length, 3), gen.problem(task, length, 3), gen.problem(task, length, 4)
        assert a == b and a.context != c.context, task
        for p in (a, c):
            n = sum(map(len, prompt_ids(tok, p)))
            assert 0.9 * length <= n <= length, (task, n)
            assert p.answers and all(isinstance(x, str) for x in p.answers)


def _token_depth(tok, p, value):
    """The share of the context's tokens before the needle holding ``value``."""
    body = p.context.split("\n\n", 1)[1]
    n = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])   # noqa: E731
    return n(body[: body.index(f"is: {value}.")]) / n(body)


def test_needles_sit_at_the_recorded_depth_and_are_asked(tok, gen):
    for task in ("niah_noise", "niah_text", "niah_multikey"):
        for i in range(5):
            p = gen.problem(task, 2048, i)
            (value,) = p.answers
            rel = _token_depth(tok, p, value)
            assert abs(rel - p.depth) < 0.04, (task, i, rel, p.depth)   # within one 30-word piece
            assert p.meta["asked"][0] in p.question and p.context.count("special magic numbers for") == len(p.meta["keys"])
    mv = gen.problem("niah_multivalue", 1024, 0)
    assert len(mv.answers) == 4 and all(f"{mv.meta['asked'][0]} is: {v}." in mv.context for v in mv.answers)
    for i in range(5):                       # the first asked key's needle sits at the recorded depth
        mq = gen.problem("niah_multiquery", 2048, i)
        assert len(mq.answers) == 2 and all(k in mq.question for k in mq.meta["asked"])
        rel = _token_depth(tok, mq, mq.answers[0])
        assert abs(rel - mq.depth) < 0.04, (i, rel, mq.depth)


def test_variable_tracking_answer_is_the_chain_holding_the_value(gen):
    p = gen.problem("vt", 2048, 1)
    assign = dict(re.findall(r"VAR (\w+) = ([\w ]+?)\.", p.context))
    def resolve(name):
        v = assign[name]
        return resolve(v[4:]) if v.startswith("VAR ") else v
    holding = sorted(n for n in assign if resolve(n) == p.meta["value"])
    assert holding == sorted(p.answers) and len(holding) == 5 and p.meta["value"] in p.question


def test_word_extraction_answers_are_the_most_frequent_words(gen):
    p = gen.problem("cwe", 2048, 0)
    counts = collections.Counter(re.findall(r"\d+\. (\w+)", p.context.split("\n\n", 1)[1]))
    top = [w for w, _ in counts.most_common(10)]
    assert sorted(top) == sorted(p.answers) and counts.most_common(11)[-1][1] < counts[p.answers[0]]
    for i in range(4):
        f = gen.problem("fwe", 1024, i)
        counts = collections.Counter(f.context.split("\n\n", 1)[1].split())
        assert [w for w, _ in counts.most_common(3)] == list(f.answers)
        assert counts.most_common(4)[2][1] > counts.most_common(4)[3][1]        # the top 3 are unique


def test_qa_asks_one_documented_person(gen):
    for i in range(3):
        p = gen.problem("qa", 1024, i)
        (answer,) = p.answers
        name = p.answer_prefix.split("Answer: ")[1].split(" was born")[0].split(" worked")[0]
        doc = next(line for line in p.context.splitlines() if line.startswith("Document") and f": {name} was" in line)
        assert answer in doc and name in p.question and p.metric == "any"


def test_prompt_ids_join_to_the_chat_prompt(tok, gen):
    p = gen.problem("niah_noise", 1024, 0)
    whole = None
    for aware in (False, True):
        head, tail = prompt_ids(tok, p, question_aware=aware)
        text = tok.decode(head + tail)
        assert head + tail == tok(text, add_special_tokens=False)["input_ids"]   # split where tokens split
        assert whole is None or head + tail == whole                              # one prompt, two splits
        whole = head + tail
        assert text.startswith("<|im_start|>system") and text.endswith(p.answer_prefix)
        assert text.count(p.question) == 1 and "<|im_start|>assistant\n" in tok.decode(tail)
        if aware:       # the question ends the compressed part; the template's end follows
            assert tok.decode(head).endswith("\n\n" + p.question) and tok.decode(tail).startswith("<|im_end|>")
        else:
            assert tok.decode(tail).startswith("\n\n" + p.question)


def test_score_and_errors(gen):
    p = Problem("x", 0, 1024, None, "c", "q", "a", ("123", "456"))
    assert score(p, "it is 123 and 456") == 1.0 and score(p, "only 456") == 0.5 and score(p, "none") == 0.0
    assert score(Problem("x", 0, 1024, None, "c", "q", "a", ("Ab",), metric="any"), "x ab") == 1.0
    with pytest.raises(ValueError, match="unknown long-context task 'nope'"):
        gen.problem("nope", 1024, 0)
    with pytest.raises(ValueError, match="too short"):
        gen.problem("vt", 100, 0)
