"""Diagnostic rows of the quality table (``variants``): a heuristic or oracle under another
budget split builds the policy it names, keeps what that split says, and bad entries are refused
by name."""

import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.data import TestbedConfig, batch
from kvjax.evaluation.budgets import budget_for
from kvjax.evaluation.config import EvalConfig
from kvjax.evaluation.policy_rows import build_policy
from kvjax.evaluation.quality import ANSWER_MAX_NEW, ORACLES, BatchContext, evaluate_policy
from train_helpers import TINY_MODEL


@pytest.fixture(scope="module")
def ctx():
    model = kvjax.Decoder(kvjax.ModelConfig.from_hf_config(TINY_MODEL), rngs=nnx.Rngs(0))
    b = batch(TestbedConfig(length=128, num_names=16), "test", 0, 2, 128)
    return BatchContext(model, b, budget_for(128, 0.75))


@pytest.mark.integration        # an evaluation run on the testbed: make test, not the test-fast loop
def test_a_variant_builds_its_base_policy_under_its_split(ctx):
    ev = ctx.ev                                                    # 4 sinks + 2 window + 26 top-k
    variants = {"l0_dense": {"policy": "oracle_peak", "budgets": "shares", "head_shares": [[100, 100], [1, 1]]},
                "tilted": {"policy": "knorm", "budgets": "shares", "head_shares": [[1.5, 0.5], [1.5, 0.5]]}}
    pol = build_policy("l0_dense", ev, {}, context=ctx.tokens.shape[1] + ANSWER_MAX_NEW, variants=variants,
                       oracle=ctx.oracle_params)
    context = 128 + ANSWER_MAX_NEW
    assert pol.name == "oracle_peak" and pol.config.k_max == context - ev.sinks - ev.window
    b = np.asarray(pol.head_budgets(pol.params, ctx.model.config, 2))
    assert b[0].min() == context - ev.sinks - ev.window and (b[1] == ev.topk).all()
    tilted = build_policy("tilted", ev, {}, context=ctx.tokens.shape[1] + ANSWER_MAX_NEW, variants=variants,
                          oracle=ctx.oracle_params)
    tb = np.asarray(tilted.head_budgets(None, ctx.model.config, 1))[:, 0]
    assert tb.sum() == 4 * ev.topk and tb[0, 0] == int(1.5 * ev.topk)      # the same total, split 3:1
    res = evaluate_policy(ctx, "l0_dense", {}, answers=False, variants=variants)
    kept = np.asarray(res[0]["kept"])                                    # [L, K, slots]
    assert ((kept[0] >= 0).sum(-1) == ctx.b["answer_start"][0]).all()   # layer 0 holds the whole prompt
    assert "answer_line" in res[0]["counts"] and "copy_name" in res[0]["counts"]


def test_bad_variants_are_refused_by_name():
    for v, msg in [({"policy": "h2o", "k_max": 3, "window": 2}, "'window' cannot be set here"),
                   ({"budgets": "shares"}, "needs `policy`"),
                   ({"policy": "kvpop_mlstm"}, "'kvpop_mlstm' is not a heuristic or oracle"),
                   ({"policy": "knorm", "budgets": "shares"}, "give it exactly when budgets='shares'")]:
        with pytest.raises(ValueError, match=msg):
            EvalConfig(policies=["dense", "v"], variants={"v": v})
    with pytest.raises(ValueError, match="'snapkv' is already a policy's name"):
        EvalConfig(policies=["snapkv"], variants={"snapkv": {"policy": "knorm"}})


def test_oracle_values_keeps_fact_values_before_anything_else(ctx):
    """``oracle_values`` ("keep every fact value"): with room for all of them it keeps every value
    of the prompt; with fewer slots, only values."""
    from kvjax.data.vocab import is_name
    from kvjax.evaluation.quality import value_priorities

    tokens = ctx.tokens
    pri = value_priorities(tokens, 2, 2, 32)
    assert pri.shape == (2, 2, 2, 160)
    values = [t for t in range(1, tokens.shape[1]) if is_name(int(tokens[0, t - 1]))]
    others = [t for t in range(tokens.shape[1]) if t not in values]
    assert pri[0, 0, 0, values].min() > pri[0, 0, 0, others].max()
    from kvjax.eviction.config import EvictionConfig
    from kvjax.evaluation.retention import kept_positions

    start = int(ctx.b["answer_start"][0])
    long_range_values = {t for t in values if 4 <= t < start - 2}          # outside sinks and window
    for topk in (len(long_range_values) + 3, 4):
        pol = build_policy("oracle_values", EvictionConfig(sinks=4, window=2, topk=topk), {}, oracle=ctx.oracle_params,
                           oracles=ORACLES)
        _, lr = kept_positions(ctx.model, tokens, ctx.b["answer_start"], pol)
        kept = set(lr[0, 0, 0][lr[0, 0, 0] >= 0].tolist())
        assert long_range_values <= kept if topk > 4 else (len(kept) == 4 and kept <= long_range_values)
