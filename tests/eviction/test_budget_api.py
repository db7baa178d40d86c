"""One public way to set any policy's budget: a fixed ``EvictionConfig`` (``at_budget``, or
``dataclasses.replace``) or a compression ratio resolved at the prompt's length
(``at_compression``, ``make_policy(name)``'s default, ``load_scorers(dir, compression=)``,
``generate(compression=)``). Learned per-head budgets are rescaled, never ignored."""

import dataclasses
import json
import math
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.eviction.config import DEFAULT_COMPRESSION, budget_at
from paths import ROOT

SHIPPED = os.path.join(ROOT, "assets")
LKV = os.path.join(SHIPPED, "smollm2-scorers", "lkv")


def test_budget_at_keeps_the_share_and_shrinks_sinks_and_window_only_when_needed():
    base = kvjax.EvictionConfig(sinks=4, window=32, topk=7, k_max=20, obs_window=5)
    ev = budget_at(base, 0.75, 1656)
    assert (ev.sinks, ev.window, ev.topk, ev.k_max, ev.obs_window) == (4, 32, 414 - 36, None, 5)
    assert budget_at(base, 0.75, 40).budget == 10 and budget_at(base, 0.75, 40).sinks == 4
    tiny = budget_at(base, 0.75, 3)
    assert (tiny.sinks, tiny.window, tiny.topk) == (0, 1, 0)
    for bad in (1.0, -0.1, "0.75", True):
        with pytest.raises(ValueError, match=r"compression must be a number in \[0, 1\)"):
            budget_at(base, bad, 100)


def test_a_loaded_lkv_policy_runs_at_a_compression_of_the_prompt_not_its_export_budget():
    """The shipped LKV export keeps 4 + 32 + 92 slots; loaded as shipped it now evicts 75% of
    whatever prompt it gets, its learned split rescaled (today: 128 slots on any prompt)."""
    pol = kvjax.load_scorers(LKV)
    assert pol.compression == DEFAULT_COMPRESSION == 0.75
    b0 = np.asarray(pol.params["budgets"])
    for length in (1656, 400):
        r = pol.resolved(length)
        ev = r.config
        assert ev.sinks + ev.window + ev.topk == round(0.25 * length) and r.compression is None
        scale = ev.topk / 92
        assert ev.k_max == max(math.ceil(184 * scale), ev.topk + 1)
        np.testing.assert_array_equal(np.asarray(r.params["budgets"]),
                                      np.minimum(np.floor(b0 * scale).astype(int), ev.k_max))
        assert np.asarray(r.params["budgets"]).sum() <= b0.size * ev.topk
    fixed = kvjax.load_scorers(LKV, compression=None)
    assert fixed.compression is None and fixed.config.budget == 128
    with pytest.raises(ValueError, match="compression ratio .* no length yet"):
        pol.init(pol.params, kvjax.preset("smollm2-135m"), 1, 64, jnp.float32, [10])


@pytest.mark.parametrize("how", ["replace", "make_policy", "at_budget", "load_config"])
def test_every_public_way_to_change_an_lkv_budget_rescales_the_learned_split(how):
    """``dataclasses.replace(policy, config=...)`` and ``make_policy("lkv", ev, params=...)``
    reported the new topk but kept the budgets learned at 92 (silently ignored)."""
    pol = kvjax.load_scorers(LKV, compression=None)
    ev = kvjax.EvictionConfig(4, 32, 220)
    new = {"replace": lambda: dataclasses.replace(pol, config=ev),
           "make_policy": lambda: kvjax.make_policy("lkv", ev, params=pol.params),
           "at_budget": lambda: pol.at_budget(ev),
           "load_config": lambda: kvjax.load_scorers(LKV, config=ev)}[how]()
    b = np.asarray(new.params["budgets"])
    assert new.config.topk == 220 and new.config.k_max > 220
    # the learned split, scaled: within one slot per head of b0 * 220 / 92, the total <= L K topk
    b0 = np.asarray(pol.params["budgets"])
    assert np.all(np.abs(b - b0 * 220 / 92) < 1.0 + 1e-6) and b.sum() <= b.size * 220
    assert math.ceil(b.mean()) >= 218
    # the config's cap holds every head's budget
    assert b.max() <= new.effective().slots


def test_an_explicit_lkv_cap_below_topk_is_refused_and_both_budget_kinds_at_once_are_refused():
    pol = kvjax.load_scorers(LKV, compression=None)
    with pytest.raises(ValueError, match="k_max=210 must exceed topk=210"):
        dataclasses.replace(pol, config=kvjax.EvictionConfig(4, 32, 210, k_max=210))
    capped = pol.at_budget(kvjax.EvictionConfig(4, 32, 210, k_max=300))       # the caller's own cap holds
    assert capped.config.k_max == 300 and int(np.asarray(capped.params["budgets"]).max()) == 300
    with pytest.raises(ValueError, match="give compression= or config=, not both"):
        kvjax.load_scorers(LKV, compression=0.5, config=kvjax.EvictionConfig(4, 32, 64))


def test_shipped_dms_and_duo_work_as_loaded_or_ask_for_a_budget():
    """Both ship with topk 0: DMS ran with sinks + window only, DuoAttention with every budget 0."""
    for name, policy in (("smollm2-dms", "dms"), ("smollm2-duo", "duo_attention")):
        pol = kvjax.load_scorers(os.path.join(SHIPPED, name))
        assert pol.name == policy and pol.compression == 0.75
        r = pol.resolved(1024)
        assert r.config.sinks + r.config.window + r.config.topk == 256 and r.config.topk == 220
        with pytest.raises(ValueError, match="exported without a long-range budget"):
            kvjax.load_scorers(os.path.join(SHIPPED, name), compression=None)
    duo = kvjax.load_scorers(os.path.join(SHIPPED, "smollm2-duo")).resolved(1024)
    assert duo.config.k_max == 1024 - 36
    b = np.asarray(duo.head_budgets(duo.params, kvjax.preset("smollm2-135m"), 1))
    assert b.sum() == 30 * 3 * 220 and b.max() == 988            # retrieval heads keep the whole context
    # a pending ratio and a fixed budget at once are refused (given only k_max, every head had 0 slots)
    pending = kvjax.load_scorers(os.path.join(SHIPPED, "smollm2-duo"))
    with pytest.raises(ValueError, match="its budget is a compression ratio .* would conflict"):
        dataclasses.replace(pending, config=dataclasses.replace(pending.config, k_max=1000))
    with pytest.raises(ValueError, match="its budget is a compression ratio .* would conflict"):
        kvjax.make_policy("knorm", kvjax.EvictionConfig(4, 32, 100), compression=0.5)
    fixed = pending.at_budget(kvjax.EvictionConfig(4, 32, 100), context=1024)       # the one way to a fixed budget
    assert fixed.compression is None and fixed.config.k_max == 988


def test_a_policy_named_without_a_budget_evicts_at_the_documented_default(tiny_llama):
    """``make_policy(name)`` gave ``EvictionConfig()`` (132 slots), so a short prompt was never
    evicted; now 75% of the prompt is, and ``generate(policy="name")`` resolves it."""
    pol = kvjax.make_policy("knorm")
    assert pol.compression == 0.75 and (pol.config.sinks, pol.config.window, pol.config.topk) == (4, 32, 0)
    prompt = [list(range(3, 83))]                                          # 80 tokens -> 20 slots
    by_name, stats = kvjax.generate(tiny_llama, prompt, 6, policy="knorm", eos_token_id=[], return_stats=True)
    explicit = kvjax.generate(tiny_llama, prompt, 6, eos_token_id=[],
                              policy=kvjax.make_policy("knorm", kvjax.EvictionConfig(4, 16, 0)))
    np.testing.assert_array_equal(np.asarray(by_name), np.asarray(explicit))
    assert stats.slots_per_head == 20 and stats.policy == "knorm"
    # generate(compression=) overrides any policy's budget
    _, s50 = kvjax.generate(tiny_llama, prompt, 6, policy="knorm", compression=0.5, eos_token_id=[],
                            return_stats=True)
    assert s50.slots_per_head == 40
    with pytest.raises(ValueError, match="compression needs a policy"):
        kvjax.generate(tiny_llama, prompt, 2, compression=0.5)


def test_generate_reports_the_kv_bytes_held_against_dense(tiny_llama):
    cfg = tiny_llama.config
    pol = kvjax.make_policy("snapkv", kvjax.EvictionConfig(2, 4, 10))
    out, stats = kvjax.generate(tiny_llama, [[5, 6, 7, 8, 9, 10]] * 2, 30, policy=pol, return_stats=True,
                                eos_token_id=[])
    cache = pol.init(None, cfg, 2, 36, tiny_llama.dtype, jnp.array([6, 6]))
    held = sum(layer.k.nbytes + layer.v.nbytes for layer in cache.layers)
    assert stats.kv_bytes == held and stats.slots_per_head == 16
    assert stats.dense_kv_bytes == 2 * cfg.num_layers * 2 * cfg.num_kv_heads * 36 * cfg.head_dim * 4
    assert 0 < stats.saved < 1 and "MB" in str(stats)
    _, dense = kvjax.generate(tiny_llama, [[5, 6, 7]], 4, return_stats=True)
    assert dense.kv_bytes == dense.dense_kv_bytes and dense.policy == "dense"


def test_a_prompt_longer_than_the_model_allows_is_blamed_on_the_prompt(tiny_llama):
    with pytest.raises(ValueError, match=r"prompt: 600 tokens exceed the model's max_position_embeddings=512"):
        kvjax.generate(tiny_llama, [[5] * 600], 1)


def _export_copy(tmp_path, edit):
    d = tmp_path / "lkv"
    shutil.copytree(LKV, d)
    meta = json.loads((d / "scorer_config.json").read_text())
    meta = edit(meta)
    (d / "scorer_config.json").write_text(json.dumps(meta))
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda m: {**m, "format_version": 2}, "format_version 2 is newer than this kvjax reads"),
    (lambda m: {}, "no 'format_version' field"),
    (lambda m: {**m, "num_layers": "30"}, "field 'num_layers' must be a positive integer, got '30'"),
    (lambda m: {k: v for k, v in m.items() if k != "kv_heads"}, "missing field 'kv_heads'"),
    (lambda m: {k: v for k, v in m.items() if k != "hidden"}, "missing field 'hidden'"),
    (lambda m: {**m, "k_max": 3}, "'k_max' must be null or an integer >= topk"),
    (lambda m: [1, 2], "expected a JSON object, got list"),
], ids=["newer-format", "empty", "wrong-type", "missing-shape", "missing-size", "bad-kmax", "not-object"])
def test_a_damaged_or_newer_scorer_config_is_refused_naming_the_file(tmp_path, edit, message):
    d = _export_copy(tmp_path, edit)
    with pytest.raises(ValueError, match=message) as e:
        kvjax.load_scorers(d)
    assert "scorer_config.json" in str(e.value)
