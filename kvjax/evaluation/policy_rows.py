"""The one policy builder of the evaluation runners: a table row's name -> its policy at a budget.

Testbed quality (:mod:`kvjax.evaluation.quality`), trace fidelity
(:mod:`kvjax.evaluation.trace_fidelity`), trace retention (:mod:`kvjax.evaluation.trace_retention`)
and the long-context runner (:mod:`kvjax.longctx.run`) name their rows the same way: ``dense``
(no policy), a label of loaded scorers (:func:`kvjax.evaluation.results_store.load_learned`), a hindsight oracle (its
priorities from the batch, ``oracle(kind)``), a variant of a registered policy (quality's
diagnostic rows) or a registered policy's name. All four store their records in a
:class:`kvjax.evaluation.results_store.ResultsStore`, fingerprinted by the digests
:func:`kvjax.evaluation.results_store.load_learned` returns.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from kvjax.eviction.config import EvictionConfig

# hindsight oracles: row name -> the kind of future attention its priorities are
ORACLES = {"oracle": "mean", "oracle_peak": "peak", "oracle_union": "union"}


def variant_config(ev: EvictionConfig, fields: dict, context: int) -> EvictionConfig:
    """``ev`` with a variant's EvictionConfig ``fields``; a ``shares`` split without ``k_max``
    gets the cap its largest share needs, at most the whole context."""
    out = dataclasses.replace(ev, **fields)
    if out.budgets == "shares" and "k_max" not in fields:
        need = int(max(max(row) for row in out.head_shares) * out.topk + 1e-9)
        out = dataclasses.replace(out, k_max=max(out.topk, min(need, context - out.sinks - out.window)))
    return out


def build_policy(name: str, ev: EvictionConfig, learned: dict, *, context: int | None = None,
                 oracle: Callable[[str], object] | None = None, oracles: dict | None = None,
                 variants: dict | None = None, learned_budgets: str | None = None):
    """The policy of row ``name`` at budget ``ev`` (``None`` for ``dense``).

    ``learned``: label -> loaded policy, rebuilt at ``ev`` (``learned_budgets``: its budget rule,
    e.g. ``"uniform"``); ``context``: the longest sequence the cache will hold (DuoAttention's
    retrieval heads, ``shares`` variants); ``oracle(kind)``: the batch's hindsight priorities of
    ``kind`` for the rows in ``oracles`` (default :data:`ORACLES`); ``variants``:
    ``{label: {"policy": base, **EvictionConfig fields}}``."""
    from kvjax.eviction.policies import make_policy

    oracles = ORACLES if oracles is None else oracles
    if name == "dense":
        return None
    if name in learned:
        rule = ev if learned_budgets is None else dataclasses.replace(ev, budgets=learned_budgets)
        return learned[name].at_budget(rule, context=context)
    if variants and name in variants:
        fields = {k: v for k, v in variants[name].items() if k != "policy"}
        name, ev = variants[name]["policy"], variant_config(ev, fields, context)
    if name in oracles:
        if oracle is None:
            raise ValueError(f"policy {name!r} ranks by hindsight priorities; this runner gives none")
        return make_policy(name, ev, params=oracle(oracles[name]))
    return make_policy(name, ev)

