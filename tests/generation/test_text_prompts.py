"""``TextGenerator`` / ``generate_text``: prompts of a wrong type are refused before any token
work with an error naming the problem, and ``generate``'s budget and cache options pass through."""

import os

import pytest

import kvjax
from paths import ROOT


@pytest.fixture(scope="module")
def gen():
    return kvjax.TextGenerator(os.path.join(ROOT, "assets", "testbed-teacher"))


@pytest.mark.parametrize("prompt, error, message", [
    (b"raw bytes", TypeError, "prompt is bytes; decode it to a string first"),
    ("caf\udce9", ValueError, r"prompt holds '\\udce9' at character 3, not valid text \(a surrogate escape"),
    (None, TypeError, "prompts must be a string, a list of strings, or chat messages.*got NoneType"),
    (123, TypeError, "prompts must be a string, a list of strings, or chat messages.*got int"),
    (["fine", None], TypeError, "prompt 1 must be a string, got NoneType"),
    (["fine", b"x"], TypeError, "prompt 1 is bytes"),
    ([{"role": "user"}], TypeError, "message 0: expected a dict with 'role' and 'content'"),
    ([], ValueError, "prompts is empty"),
], ids=["bytes", "surrogateescape", "None", "int", "None-in-list", "bytes-in-list", "bad-message", "empty"])
def test_a_prompt_of_the_wrong_kind_is_refused_clearly(gen, prompt, error, message):
    with pytest.raises(error, match=message):
        gen(prompt, max_new_tokens=2)


def test_prefill_max_cache_len_and_compression_pass_through(gen):
    with pytest.raises(ValueError, match="exceeds the cache size max_cache_len=3"):
        gen("a b c d", max_new_tokens=4, max_cache_len=3)
    out, stats = gen("a b c d e f g h", max_new_tokens=3, policy="knorm", compression=0.5, return_stats=True)
    assert isinstance(out, str) and stats is gen.last_stats and stats.policy == "knorm"
    n = stats.prompt_length
    assert stats.slots_per_head == round(0.5 * n)
    stepwise = gen("a b c d e f g h", max_new_tokens=3, policy=kvjax.make_policy("knorm").with_prefill("stepwise"),
                   compression=0.5)
    assert isinstance(stepwise, str)
    with pytest.raises(ValueError, match="compression needs a policy"):
        kvjax.TextGenerator(gen.model, gen.tokenizer, compression=0.5)
