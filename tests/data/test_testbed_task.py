"""The synthetic reasoning-trace testbed: generator, labels, tokenizer, metrics."""

import json

import numpy as np
import pytest

from kvjax.data import (
    CATEGORIES,
    COMPUTE,
    EOS_ID,
    LINE_KINDS,
    LOOKUP_FAR,
    OTHER,
    LOOKUP_NEAR,
    PAD_ID,
    VOCAB_SIZE,
    TestbedConfig,
    apply_op,
    batch,
    build_tokenizer,
    category_accuracy,
    category_counts,
    check_answer,
    dataset_statistics,
    generate_problem,
    parse_answer,
    predictions_from_logits,
    save_tokenizer,
    step_batches,
)
from kvjax.data.vocab import TOKENS, id_to_number, is_name, name_id, tok

CONFIGS = [
    TestbedConfig(length=512),
    TestbedConfig(length=1024, ops=("+", "-", "*"), num_values=20, seed=3),
    TestbedConfig(length=256, num_names=8, num_defs=4, answer_terms=(2, 3), far_prob=0.9),
]


def _arrays(p):
    return (p.tokens, p.category, p.deps, p.line_kind, p.prompt_len, p.answer_start, p.answer_pos, p.answer)


def test_same_seed_same_problems_and_other_seed_differs():
    cfg = TestbedConfig(length=512)
    for i in range(4):
        for a, b in zip(_arrays(generate_problem(cfg, "train", i)), _arrays(generate_problem(cfg, "train", i))):
            np.testing.assert_array_equal(a, b)
    b1, b2 = batch(cfg, "valid", 5, 3, 600), batch(cfg, "valid", 5, 3, 600)
    assert all(np.array_equal(b1[k], b2[k]) for k in b1)
    other = TestbedConfig(length=512, seed=1)
    assert generate_problem(cfg, "train", 0).text != generate_problem(other, "train", 0).text
    assert generate_problem(cfg, "train", 0).text != generate_problem(cfg, "train", 1).text


def test_splits_do_not_overlap():
    cfg = TestbedConfig(length=128, num_names=16, num_defs=4)
    texts = {split: {generate_problem(cfg, split, i).text for i in range(150)} for split in ("train", "valid", "test")}
    assert len(texts["train"]) == 150
    assert not texts["train"] & texts["test"]
    assert not texts["train"] & texts["valid"]
    assert not texts["valid"] & texts["test"]


def _check_problem(cfg, p):
    t, cat, deps = p.tokens, p.category, p.deps
    n = len(t)
    assert t.dtype == np.int32 and cat.dtype == np.int8 and deps.shape == (n, 2)
    assert t[0] == tok("<bos>") and t[-1] == EOS_ID and t[-2] == tok(";")
    assert [TOKENS[i] for i in t[p.prompt_len - 2 : p.prompt_len]] == ["trace", ":"]
    assert TOKENS[t[p.answer_start - 1]] == "answer" and p.answer_pos == n - 3
    assert id_to_number(t[p.answer_pos]) == p.answer and cat[p.answer_pos] == COMPUTE
    assert parse_answer(t[p.answer_start :]) == p.answer
    bound = {}  # name -> position of its (only) binding
    for i in np.flatnonzero([is_name(x) for x in t[:-1]]):
        name, value_pos = int(t[i]), i + 1
        if id_to_number(t[value_pos]) is not None and cat[value_pos] not in (LOOKUP_NEAR, LOOKUP_FAR):
            assert name not in bound, "a name is bound twice"
            bound[name] = value_pos
    for i in np.flatnonzero((cat == LOOKUP_NEAR) | (cat == LOOKUP_FAR)):
        src = deps[i, 0]
        assert 0 < src < i and deps[i, 1] == -1
        assert t[i] == t[src] and t[i - 1] == t[src - 1] and is_name(t[i - 1])
        name = t[i - 1]
        assert bound[int(name)] < i  # defined before it is looked up
        between = [j for j in range(src + 1, i - 1) if t[j] == name and id_to_number(t[j + 1]) is not None]
        assert len(between) == 0, "a lookup copies the latest occurrence of its fact"
        root = src
        while cat[root] in (LOOKUP_NEAR, LOOKUP_FAR):
            root = deps[root, 0]
        assert root == bound[int(name)]
        assert (cat[i] == LOOKUP_FAR) == (i - src > cfg.far_threshold)
    for i in np.flatnonzero(cat == COMPUTE):
        a, b = deps[i]
        assert 0 < a < b < i and i - a <= 8, "arithmetic is local"
        assert TOKENS[t[i - 1]] == "->", "a result is computed right after its arrow"
        if is_name(t[i + 1]):                       # `-> r NAME r`: the binding copies the result
            assert t[i + 2] == t[i] and cat[i + 2] == OTHER and deps[i + 2, 0] == i
        op = TOKENS[t[a + 1]]
        assert id_to_number(t[i]) == apply_op(op, id_to_number(t[a]), id_to_number(t[b]), cfg.num_values)
    values = [id_to_number(x) for x in t if id_to_number(x) is not None]
    assert max(values) < cfg.num_values
    assert len({int(x) for x in t if is_name(x)}) <= cfg.num_names


@pytest.mark.parametrize("cfg", CONFIGS, ids=["512", "1024-mul", "curriculum"])
def test_labels_are_consistent(cfg):
    for i in range(6):
        p = generate_problem(cfg, "train", i)
        _check_problem(cfg, p)
        assert (p.category == LOOKUP_FAR).any() or cfg.length < 512


def test_names_come_from_the_first_num_names():
    cfg = TestbedConfig(length=256, num_names=8, num_defs=4, answer_terms=(2, 3))
    first = {name_id(k) for k in range(8)}
    for i in range(10):
        assert {int(x) for x in generate_problem(cfg, "train", i).tokens if is_name(x)} <= first


@pytest.mark.parametrize("length", [512, 1024, 2048, 4096])
def test_lengths_and_delays_scale_with_length(length):
    cfg = TestbedConfig(length=length)
    problems = [generate_problem(cfg, "valid", i) for i in range(6)]
    lengths = np.array([len(p) for p in problems])
    assert lengths.max() <= length and lengths.mean() >= length - 8
    dist = np.concatenate([np.flatnonzero(p.category == LOOKUP_FAR) - p.deps[p.category == LOOKUP_FAR, 0]
                           for p in problems])
    assert len(dist) >= len(problems) and dist.min() > length // 4 and np.median(dist) > length // 3


def test_scaled_keeps_knobs():
    cfg = TestbedConfig(length=512, num_names=40)
    assert cfg.scaled(4) == TestbedConfig(length=2048, num_names=40)
    assert cfg.scaled(4).far_threshold == 4 * cfg.far_threshold


def test_tokenizer_round_trip_and_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    p = generate_problem(TestbedConfig(length=512), "test", 0)
    tokenizer = build_tokenizer()
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert tokenizer.encode(p.text).ids == p.tokens.tolist()
    assert tokenizer.decode(p.tokens.tolist(), skip_special_tokens=False) == p.text
    save_tokenizer(tmp_path)
    assert json.loads((tmp_path / "special_tokens_map.json").read_text())["pad_token"] == "<pad>"
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (PAD_ID, tok("<bos>"), EOS_ID)
    assert len(hf) == VOCAB_SIZE
    assert hf(p.text)["input_ids"] == p.tokens.tolist()
    assert hf.decode(p.tokens.tolist()) == p.text


@pytest.mark.parametrize("bad, field", [
    (dict(length=90), "length"),
    (dict(num_values=1), "num_values"),
    (dict(num_values=21), "num_values"),
    (dict(ops=("/",)), "ops"),
    (dict(ops=()), "ops"),
    (dict(num_names=3), "num_names"),
    (dict(num_names=10_000), "num_names"),
    (dict(num_defs=2), "num_defs"),
    (dict(keep_reuse=1.5), "keep_reuse"),
    (dict(far_frac=0.0), "far_frac"),
    (dict(scratch_steps=(3, 2)), "scratch_steps"),
    (dict(answer_terms=(1, 3)), "answer_terms"),
    (dict(min_delay=0), "min_delay"),
    (dict(seed=-1), "seed"),
    (dict(length=512.0), "length"),
])
def test_config_validation_names_the_field(bad, field):
    with pytest.raises(ValueError, match=rf"TestbedConfig\.{field} "):
        TestbedConfig(**bad)


def test_config_accepts_lists_from_yaml():
    assert TestbedConfig(ops=["+", "*"], scratch_steps=[1, 3]).ops == ("+", "*")


def test_batch_layout_and_errors():
    cfg = TestbedConfig(length=512)
    out = batch(cfg, "train", 10, 4, 520)
    assert out["tokens"].shape == (4, 520) and out["tokens"].dtype == np.int32
    for row in range(4):
        p = generate_problem(cfg, "train", 10 + row)
        n = out["length"][row]
        assert n == len(p) and (out["tokens"][row, n:] == PAD_ID).all()
        assert out["loss_mask"][row].sum() == n - 1 and not out["loss_mask"][row, 0]
        np.testing.assert_array_equal(out["category"][row, :n], p.category)
        assert out["answer"][row] == p.answer and out["answer_start"][row] == p.answer_start
        assert (out["last_use"][row, :n] >= -1).all()
    with pytest.raises(ValueError, match="seq_len"):
        batch(cfg, "train", 0, 2, 256)
    with pytest.raises(ValueError, match="split"):
        batch(cfg, "dev", 0, 2, 512)


def test_step_batches_mark_the_predicting_positions():
    cfg = TestbedConfig(length=256)
    tokens, mask = step_batches(cfg, "train", 3, 260)(2)                 # problems 6, 7, 8
    _, retrieval = step_batches(cfg, "train", 3, 260, positions="retrieval")(2)
    for row in range(3):
        p = generate_problem(cfg, "train", 6 + row)
        n = len(p)
        np.testing.assert_array_equal(tokens[row, :n], p.tokens)
        assert mask[row].tolist() == [1.0] * (n - 1) + [0.0] * (260 - n + 1)     # position t predicts t + 1
        want = [t - 1 for t in range(1, n) if p.category[t] in (LOOKUP_NEAR, LOOKUP_FAR) or t >= p.answer_start]
        assert np.flatnonzero(retrieval[row]).tolist() == want and len(want) < n - 1
    with pytest.raises(ValueError, match="positions must be"):
        step_batches(cfg, "train", 1, 256, positions="answers")


def test_metrics():
    cfg = TestbedConfig(length=512)
    out = batch(cfg, "valid", 0, 3, 512)
    tokens, cat = out["tokens"], out["category"]
    logits = np.eye(VOCAB_SIZE, dtype=np.float32)[tokens[:, 1:]]
    logits = np.concatenate([logits, np.zeros_like(logits[:, :1])], axis=1)
    pred = predictions_from_logits(logits)
    assert pred.shape == tokens.shape and (pred[:, 1:] == tokens[:, 1:]).all()
    assert all(v == 1.0 for v in category_accuracy(pred, tokens, cat).values())
    wrong = np.where(cat == LOOKUP_FAR, PAD_ID, pred)
    acc = category_accuracy(wrong, tokens, cat)
    assert acc["lookup_far"] == 0.0 and acc["lookup_near"] == acc["compute"] == 1.0 and 0 < acc["graded"] < 1
    p = generate_problem(cfg, "valid", 0)
    span = p.tokens[p.answer_start :]
    assert check_answer(span, p.answer) and check_answer(np.append(span, [PAD_ID] * 3), p.answer)
    assert not check_answer(span, (p.answer + 1) % cfg.num_values)
    assert parse_answer(span[:-2]) is None and parse_answer([tok("5"), tok(";")]) is None


def test_answer_line_copies_are_graded_on_their_own():
    """The answer line's names and operators are `copy_name` / `copy_op` (copies of the query
    line, outside the `graded` pool); `answer_line` fails a row for any wrong token of its line."""
    from kvjax.data import COPY_NAME, COPY_OP

    cfg = TestbedConfig(length=512)
    out = batch(cfg, "valid", 0, 4, 512)
    tokens, cat, start = out["tokens"], out["category"], out["answer_start"]
    for row in range(4):
        p = generate_problem(cfg, "valid", row)
        names = np.flatnonzero(p.category == COPY_NAME)
        ops = np.flatnonzero(p.category == COPY_OP)
        terms = len(names)
        assert 2 <= terms <= 4 and len(ops) == terms - 1 and (names >= p.answer_start).all()
        assert all(p.tokens[t] == p.tokens[p.deps[t, 0]] and p.deps[t, 0] < p.answer_start for t in [*names, *ops])
        assert all(is_name(p.tokens[t]) for t in names)
    pred = np.concatenate([np.full_like(tokens[:, :1], -1), tokens[:, 1:]], axis=1)
    counts = category_counts(pred, tokens, cat, start)
    assert counts["answer_line"] == (4, 4) and counts["copy_name"][0] == counts["copy_name"][1] > 0
    graded_before = counts["graded"]
    wrong = pred.copy()
    first_op = np.flatnonzero(cat[1] == COPY_OP)[0]
    wrong[1, first_op] = PAD_ID                              # one operator copy of row 1
    counts = category_counts(wrong, tokens, cat, start)
    assert counts["answer_line"] == (3, 4) and counts["copy_op"][0] == counts["copy_op"][1] - 1
    assert counts["graded"] == graded_before                 # the pool is lookups and computation only
    wrong[2, np.flatnonzero(tokens[2] == EOS_ID)[0]] = PAD_ID     # the <eos> belongs to the line
    assert category_counts(wrong, tokens, cat, start)["answer_line"] == (2, 4)
    assert "answer_line" not in category_counts(pred, tokens, cat)


def test_marker_predicts_reuse_and_oracle_view():
    stats = dataset_statistics(TestbedConfig(length=1024), "valid", 8)
    assert stats["reused_fraction"]["keep"] > 0.6 > 0.3 > stats["reused_fraction"]["let"]
    p = generate_problem(TestbedConfig(length=512), "valid", 0)
    last = p.last_use
    work = p.line_kind == LINE_KINDS.index("work")
    assert (last[work] - np.arange(len(p))[work] <= 8).all(), "scratch is needed only locally"


def test_print_statistics():
    """Not a check: prints the task's statistics at the training lengths (see with -s)."""
    for length in (512, 1024):
        stats = dataset_statistics(TestbedConfig(length=length), "valid", 32)
        print(json.dumps(stats))
    assert set(stats["category_fraction"]) == set(CATEGORIES)


def test_recall_lines_are_pure_lookups():
    """recall_prob (curriculum): `use NAME v ;` lines whose value copies the fact's latest value."""
    cfg = TestbedConfig(length=160, num_names=16, num_defs=8, recall_prob=1.0, keep_reuse=0.0, let_reuse=0.0,
                        scratch_prob=0.0)
    lookups = 0
    for i in range(20):
        p = generate_problem(cfg, "train", i)
        t = p.tokens
        for pos in np.flatnonzero(t[:-3] == tok("use")):
            assert is_name(t[pos + 1]) and t[pos + 3] == tok(";")
            v = pos + 2
            assert p.category[v] in (LOOKUP_NEAR, LOOKUP_FAR) and t[p.deps[v, 0]] == t[v]
            lookups += 1
    assert lookups >= 100
    with pytest.raises(ValueError, match="recall_prob"):
        TestbedConfig(recall_prob=1.5)
