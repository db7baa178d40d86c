"""Jitted dense generation: token-for-token parity with ``transformers.generate``."""

import numpy as np
import pytest
import torch

import kvjax
from hf_models import make_hf_model


@pytest.fixture(scope="module", params=["qwen3-gqa", "llama-mqa-llama3rope"])
def pair(request, tmp_path_factory):
    ref = make_hf_model(request.param, init_std=0.25)
    folder = tmp_path_factory.mktemp("gen")
    ref.save_pretrained(folder)
    return kvjax.load_hf(folder), ref


def left_padded(lengths, seed=1, pad=0):
    rs = np.random.RandomState(seed)
    S = max(lengths)
    ids = np.full((len(lengths), S), pad, np.int64)
    mask = np.zeros((len(lengths), S), np.int64)
    for b, n in enumerate(lengths):
        ids[b, S - n:] = rs.randint(3, 97, n)
        mask[b, S - n:] = 1
    return ids, mask


def hf_generate(ref, ids, mask, n, **kw):
    with torch.no_grad():
        return ref.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=n,
                            do_sample=False, pad_token_id=0, **kw).numpy()


def test_greedy_matches_transformers(pair):
    model, ref = pair
    ids, mask = left_padded([7, 15, 11])
    want = hf_generate(ref, ids, mask, 40, eos_token_id=None, min_new_tokens=40)
    got = np.asarray(kvjax.generate(model, ids, 40, attention_mask=mask, eos_token_id=[]))
    assert got.shape == (3, 15 + 40) and got.dtype == np.int32
    assert len(np.unique(want[:, 15:])) > 8   # the comparison is not between constant streams
    np.testing.assert_array_equal(got, want)


def test_ragged_list_prompt_equals_masked_array(pair):
    model, _ = pair
    ids, mask = left_padded([5, 9])
    rows = [ids[b][mask[b] == 1].tolist() for b in range(2)]
    a = kvjax.generate(model, rows, 12, eos_token_id=[])
    b = kvjax.generate(model, ids, 12, attention_mask=mask, eos_token_id=[])
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_eos_stops_each_row_and_pads(pair):
    model, ref = pair
    ids, mask = left_padded([6, 10], seed=3)
    free = np.asarray(kvjax.generate(model, ids, 32, attention_mask=mask, eos_token_id=[]))
    eos = int(free[0, 10 + 5])             # a token row 0 emits at step 5: make it the EOS
    want = hf_generate(ref, ids, mask, 32, eos_token_id=eos)
    got = np.asarray(kvjax.generate(model, ids, 32, attention_mask=mask, eos_token_id=eos, pad_token_id=0))
    np.testing.assert_array_equal(got[:, :want.shape[1]], want)
    assert (got[:, want.shape[1]:] == 0).all()
    row0 = got[0, 10:]
    first = int(np.flatnonzero(row0 == eos)[0])
    assert first <= 5 and (row0[first + 1:] == 0).all()


def test_sampling_is_seeded(pair):
    model, _ = pair
    ids, mask = left_padded([8, 8])
    a = np.asarray(kvjax.generate(model, ids, 24, temperature=1.0, seed=0, eos_token_id=[]))
    b = np.asarray(kvjax.generate(model, ids, 24, temperature=1.0, seed=0, eos_token_id=[]))
    c = np.asarray(kvjax.generate(model, ids, 24, temperature=1.0, seed=1, eos_token_id=[]))
    greedy = np.asarray(kvjax.generate(model, ids, 24, eos_token_id=[]))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any() and (a != greedy).any()


def test_generate_errors(pair):
    model, _ = pair
    with pytest.raises(ValueError, match="max_cache_len=20"):
        kvjax.generate(model, [[5, 6, 7]], 18, max_cache_len=20)
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        kvjax.generate(model, [[5, 6, 7]], 510)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        kvjax.generate(model, [[5, 6, 7]], 0)
    with pytest.raises(ValueError, match="prompt row 1 is empty"):
        kvjax.generate(model, [[5, 6], []], 4)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 97\)"):
        kvjax.generate(model, [[5, 600]], 4)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        kvjax.generate(model, [[5]], 4, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        kvjax.generate(model, [[5]], 4, temperature=float("nan"))
    with pytest.raises(TypeError, match="token ids must be integers, got 4.9"):
        kvjax.generate(model, [[4.9, 12.2]], 4)
    with pytest.raises(TypeError, match="token ids must be integers, got dtype float"):
        kvjax.generate(model, np.array([[4.9, 12.2]]), 4)


@pytest.mark.parametrize("policy", [None, "streaming_llm", "h2o", "knorm"])
def test_length_buckets_give_the_unbucketed_tokens(pair, policy):
    model, _ = pair
    ids, mask = left_padded([5, 13, 9], seed=7)
    pol = None if policy is None else kvjax.make_policy(policy, kvjax.EvictionConfig(sinks=2, window=4, topk=6))
    for kw in (dict(), dict(temperature=0.8, top_p=0.9, seed=4)):
        a = np.asarray(kvjax.generate(model, ids, 21, attention_mask=mask, policy=pol, eos_token_id=[], **kw))
        b = np.asarray(kvjax.generate(model, ids, 21, attention_mask=mask, policy=pol, eos_token_id=[],
                                      bucket_lengths=False, **kw))
        assert a.shape == (3, 13 + 21)
        np.testing.assert_array_equal(a, b)


def test_stepwise_prefill_is_bounded_throughout(pair):
    """A policy with ``prefill="stepwise"`` feeds the prompt through the decode path: for
    static-priority policies it gives ``prefill="auto"``'s tokens (and EOS handling); for
    SnapKV, whose ``auto`` prefill is dense, its first token is the argmax of the teacher-forced
    token-by-token logits (:func:`kvjax.eviction.forced.stepwise_logits`), not the dense one."""
    from kvjax.eviction.forced import stepwise_logits

    model, _ = pair
    ids, mask = left_padded([6, 17, 11], seed=5)
    ev = kvjax.EvictionConfig(sinks=2, window=3, topk=4)
    for pol in (kvjax.make_policy("knorm", ev), kvjax.make_policy("streaming_llm", ev)):
        a = np.asarray(kvjax.generate(model, ids, 9, attention_mask=mask, policy=pol))
        b = np.asarray(kvjax.generate(model, ids, 9, attention_mask=mask, policy=pol.with_prefill("stepwise")))
        np.testing.assert_array_equal(a, b)
    snap = kvjax.make_policy("snapkv", ev)
    row = ids[1:2, mask[1].argmax():]
    first = np.asarray(kvjax.generate(model, row, 1, policy=snap.with_prefill("stepwise"), eos_token_id=[]))[0, -1]
    assert first == int(np.argmax(np.asarray(stepwise_logits(model, row, snap))[0, -1]))
    auto = np.asarray(kvjax.generate(model, ids, 9, attention_mask=mask, policy=snap, eos_token_id=[]))
    step = np.asarray(kvjax.generate(model, ids, 9, attention_mask=mask, policy=snap.with_prefill("stepwise"),
                                     eos_token_id=[]))
    assert (auto != step).any()                   # a dense prefill is not a bounded one
    with pytest.raises(ValueError, match="EvictionConfig.prefill must be one of 'auto', 'chunked', 'stepwise', "
                                         "'compressed', got 'dense'"):
        snap.with_prefill("dense")
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefill'"):
        kvjax.generate(model, ids, 2, prefill="stepwise")


def test_compressed_prefill_is_prompt_compression(pair):
    """``prefill="compressed"`` is kvpress's setting: each row's prompt compressed once at the ratio,
    the same tokens as the prompt-compressed policy built by hand; it needs a compression."""
    from kvjax.eviction.prompt_compressed import prompt_compressed

    model, _ = pair
    ids, mask = left_padded([30, 24], seed=7)
    rows = [ids[b][mask[b] == 1].tolist() for b in range(2)]
    ev = kvjax.EvictionConfig(sinks=2, window=3, topk=0)
    for name in ("knorm", "snapkv"):
        pol = kvjax.make_policy(name, ev, compression=0.5).with_prefill("compressed")
        got = np.asarray(kvjax.generate(model, rows, 8, policy=pol, eos_token_id=[]))
        ranker = kvjax.make_policy(name, ev, compression=0.5).at_compression(0.5, 30)
        want = np.asarray(kvjax.generate(model, rows, 8, policy=prompt_compressed(ranker, 0.5, [30, 24]),
                                         eos_token_id=[]))
        np.testing.assert_array_equal(got, want)
        assert len(np.unique(got[:, 30:])) > 2
    fixed = kvjax.make_policy("knorm", kvjax.EvictionConfig(2, 3, 4)).with_prefill("compressed")
    with pytest.raises(ValueError, match="prefill='compressed', which keeps a share of each prompt"):
        kvjax.generate(model, rows, 2, policy=fixed)
    by_arg = np.asarray(kvjax.generate(model, rows, 8, policy=fixed, compression=0.5, eos_token_id=[]))
    by_hand = prompt_compressed(fixed.at_compression(0.5, 30), 0.5, [30, 24])
    np.testing.assert_array_equal(by_arg, np.asarray(kvjax.generate(model, rows, 8, policy=by_hand, eos_token_id=[])))


def test_many_lengths_compile_a_bounded_number_of_programs(hf_dir):
    """120 calls with distinct prompt lengths (10..486, every bucket) and 3 generation lengths in one process."""
    from kvjax.generate import _generate
    from kvjax.sampling import bucket

    model = kvjax.load_hf(hf_dir("qwen3-gqa")[0])
    before = _generate._cache_size()
    lengths = range(10, 490, 4)
    for i, n in enumerate(lengths):
        new = (5, 6, 7)[i % 3]
        out = kvjax.generate(model, [[3 + (j % 90) for j in range(n)]], new, eos_token_id=[])
        assert out.shape == (1, n + new)
    programs = _generate._cache_size() - before
    assert programs <= len({bucket(n) for n in lengths}) <= 20, programs
