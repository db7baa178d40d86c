"""Training haystacks: the longctx runner's own context ids, under seeds disjoint from the evaluation's."""

import json

import pytest
import transformers

from kvjax.longctx.tasks import Generator, prompt_ids
from kvjax.real_model import ensure_model
from kvjax.scorer_fit.haystacks import HaystackConfig, write_haystacks


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(ensure_model())


def test_rows_are_the_runners_context_ids_under_the_training_seeds(tok, tmp_path):
    cfg = HaystackConfig(out_dir=str(tmp_path), tasks=["niah_multikey", "vt"], train=2, valid=1,
                         seeds={"train": 7, "valid": 8})
    summary = write_haystacks(cfg, tokenizer=tok, progress=False)
    assert summary["train"]["rows"] == 4 and summary["valid"]["rows"] == 2
    gen = Generator(tok)
    for split, seed in (("train", 7), ("valid", 8)):
        rows = [json.loads(line) for line in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        assert sum(len(r["tokens"]) for r in rows) == summary[split]["tokens"]
        for r in rows:
            length, task, i, _ = r["id"].split("/")
            mine = gen.problem(task, int(length), int(i), seed)
            ctx, _ = prompt_ids(tok, mine)
            assert r["tokens"] == ctx and r["prompt_len"] == len(ctx)
            evaluated = gen.problem(task, int(length), int(i), 0)      # the table's problem of the same index
            assert set(mine.answers).isdisjoint(evaluated.answers)
            assert mine.context != evaluated.context
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("kw,match", [
    ({"seeds": {"train": 0, "valid": 3}}, "reuses the evaluation's seed 0"),
    ({"seeds": {"train": 5, "valid": 5}}, "share seed 5"),
    ({"seeds": {"train": 5}}, "one seed for each of train and valid"),
    ({"tasks": ["niah_nope"]}, "unknown task 'niah_nope'"),
    ({"train": 0}, "train and valid must be >= 1"),
])
def test_bad_configs_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        HaystackConfig(**kw)
