"""``experiments/testbed_kvpress.py``: the exported testbed problems split each prompt at its query
line, so kvpress compresses the program and never the question."""

import importlib.util
import os

from paths import ROOT

from kvjax.data import TestbedConfig, generate_problem
from kvjax.data.vocab import TOKEN_TO_ID


def _bench():
    spec = importlib.util.spec_from_file_location("testbed_kvpress", os.path.join(ROOT, "experiments", "testbed_kvpress.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_export_splits_each_prompt_at_its_query_line():
    bench = _bench()
    for i, p in enumerate(bench.problems(6)):
        src = generate_problem(TestbedConfig(length=512), "test", i)
        assert p["context_ids"] + p["question_ids"] == src.tokens[: src.answer_start].tolist()
        assert p["question_ids"][0] == TOKEN_TO_ID["query"] and p["question_ids"][-1] == TOKEN_TO_ID["answer"]
        assert TOKEN_TO_ID["query"] not in p["context_ids"]
        assert p["answer"] == src.answer


def test_line_stops_before_the_first_eos():
    assert _bench().line([5, 6, 2, 7, 2], eos=2) == [5, 6]
    assert _bench().line([5, 6], eos=2) == [5, 6]
