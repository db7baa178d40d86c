"""``kvjax policies``, ``kvjax tasks``, ``kvjax scorers``: what the library holds, one line each."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_BUDGET = "sinks + window + topk"

# name -> (what ranks the tokens, what it needs besides the budget); the budget is per KV head:
# EvictionConfig(sinks, window, topk[, k_max]) (kvjax/eviction/config.py)
POLICY_NOTES: dict[str, tuple[str, str]] = {
    "streaming_llm": ("no ranking: the topk slots join the window (sinks + the window + topk latest tokens)",
                      _BUDGET),
    "random": ("a seeded hash of (layer, head, position)", f"{_BUDGET}; seed"),
    "knorm": ("low key norm first", _BUDGET),
    "tova": ("attention from the latest query", _BUDGET),
    "h2o": ("attention summed over every query so far", _BUDGET),
    "snapkv": ("attention from an observation window of queries, pooled", f"{_BUDGET}; obs_window, pool"),
    "keydiff": ("keys least like the head's mean normalised key first (KeyDiff)", _BUDGET),
    "kvzip": ("the most attention a token gets while the model repeats its context (KVzip)",
              f"{_BUDGET}; budgets 'global' (default) or 'layer'; prefill compression (kvjax.prompt_compressed) "
              "or bounded throughout, the prompt scored first; the model's tokenizer"),
    "pyramidkv": ("SnapKV's ranking, layer budgets falling with depth (PyramidKV)",
                  f"{_BUDGET}; k_max (default 2 topk), pyramid_beta"),
    "adakv": ("SnapKV's ranking, per-head budgets split from the scores (Ada-KV)",
              f"{_BUDGET}; k_max (default 2 topk), adakv_alpha"),
    "oracle": ("the dense model's future attention, known in hindsight",
               f"{_BUDGET}; params: priorities [L, B, K, T] (kvjax.evaluation.oracle.oracle_priorities)"),
    "oracle_peak": ("hindsight: the peak single-query future attention",
                    f"{_BUDGET}; params: priorities [L, B, K, T] (oracle_priorities, kind=\"peak\")"),
    "oracle_union": ("hindsight: the better of the mean and peak ranks",
                     f"{_BUDGET}; params: priorities [L, B, K, T] (oracle_priorities, kind=\"union\")"),
    "oracle_values": ("diagnostic: the testbed's fact values first",
                      f"{_BUDGET}; params: priorities [L, B, K, T] (the testbed evaluation builds them)"),
    "kvpop_mlp": ("KVpop: a trained per-head MLP on [k; v] plus a learned recency term",
                  f"{_BUDGET}; trained weights (kvjax.load_scorers(dir), train.py mode distill_kvpop)"),
    "kvpop_mlstm": ("KVpop: a trained per-head mLSTM read out one window later",
                    f"{_BUDGET}; trained weights (kvjax.load_scorers(dir), train.py mode distill_kvpop)"),
    "lkv": ("LKV: trained per-head budgets (LKV-H) and token scores (LKV-T)",
            f"{_BUDGET} with 0 < topk < k_max; trained weights (kvjax.load_scorers(dir), "
            "train.py mode distill_lkv)"),
    "lkv_kvpop_mlstm": ("LKV's per-head budgets with KVpop's mLSTM choosing the tokens",
                        f"{_BUDGET} with 0 < topk < k_max; trained weights (kvjax.load_scorers(dir))"),
    "duo_attention": ("DuoAttention: trained per-head gates pick retrieval heads (k_max slots) and "
                      "streaming heads (none)",
                      f"{_BUDGET}; k_max required (a retrieval head's cap); trained gates "
                      "(kvjax duo, kvjax.load_scorers(dir))"),
    "dms": ("DMS: trained per-head eviction decisions on [k; v], as a ranking",
            f"{_BUDGET}; trained decisions (kvjax dms, kvjax.load_scorers(dir))"),
}


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def policies(argv: list[str]) -> int:
    """Every registered policy, what ranks its tokens and the budget fields it needs."""
    import kvjax

    rows = []
    for name in sorted(kvjax.POLICIES):
        what, needs = POLICY_NOTES.get(name) or ((kvjax.POLICIES[name].__doc__ or "").strip().split("\n")[0],
                                                  _BUDGET)
        rows.append((name, what, needs))
    width = max(len(r[0]) for r in rows)
    print("Eviction policies: kvjax.make_policy(name, kvjax.EvictionConfig(sinks, window, topk, k_max=...), params);"
          " the budget is per KV head\n")
    for name, what, needs in rows:
        print(f"{name:<{width}}  {what}\n{'':<{width}}  needs: {needs}")
    return 0


def _task_notes() -> dict[str, str]:
    """``{task: its line}`` from the table in :mod:`kvjax.longctx.tasks`'s docstring."""
    from kvjax.longctx import tasks

    notes: dict[str, str] = {}
    current = None
    for line in (tasks.__doc__ or "").splitlines():
        m = re.match(r"``(\w+)``\s+(.*)", line)
        if m and m.group(1) in tasks.TASKS:
            current = m.group(1)
            notes[current] = m.group(2).strip()
        elif current and line.startswith(" ") and line.strip():
            notes[current] += " " + line.strip()
        else:
            current = None
    return {t: n.replace("``", "") for t, n in notes.items()}


def tasks(argv: list[str]) -> int:
    """The RULER-style long-context tasks of ``kvjax longctx`` (``tasks:`` in its config)."""
    from kvjax.longctx.tasks import TASKS

    notes = _task_notes()
    print("Long-context tasks (kvjax longctx: the config's tasks: [...]; kvjax.longctx.tasks):\n")
    print(_table([(t, notes.get(t, "")) for t in TASKS]))
    return 0


# exports without a "policy" field name it by their scorer type (kvjax.export reads them the same way)
_LEGACY = {"mlp": "kvpop_mlp", "lkv": "lkv", "dms": "dms", "duo": "duo_attention"}


def scorer_policy(meta: dict) -> str:
    """The registered policy an exported ``scorer_config.json`` holds."""
    if meta.get("policy"):
        return meta["policy"]
    if meta.get("scorer") == "mlstm":
        return "kvpop_mlstm" if meta.get("lkv_budgets") is None else "lkv_kvpop_mlstm"
    return _LEGACY.get(meta.get("scorer"), f"? (scorer {meta.get('scorer')!r})")


def shipped_scorers(root: Path) -> list[Path]:
    """Every folder under ``root`` holding an exported ``scorer_config.json``."""
    return sorted(p.parent for p in root.rglob("scorer_config.json"))


def scorers(argv: list[str]) -> int:
    """The trained scorers shipped in the repository's ``assets/`` (``kvjax.load_scorers(folder)``)."""
    from kvjax.assets import AssetsNotFound, assets_dir

    try:
        root = assets_dir()
    except AssetsNotFound as e:
        print(f"kvjax scorers: {e}", file=sys.stderr)
        return 1
    rows = [("folder", "policy", "model it fits", "budget")]
    for folder in shipped_scorers(root):
        meta = json.loads((folder / "scorer_config.json").read_text())
        shapes = f"{meta.get('num_layers')} layers x {meta.get('kv_heads')} KV heads x head_dim {meta.get('head_dim')}"
        model = f"{Path(str(meta['base_model'])).name} ({shapes})" if meta.get("base_model") else shapes
        budget = f"sinks={meta.get('sinks')} window={meta.get('window')} topk={meta.get('topk')}" + (
            f" k_max={meta['k_max']}" if meta.get("k_max") is not None else "") + (
            " (topk set at use)" if not meta.get("topk") else "")
        rows.append((str(folder.relative_to(root)), scorer_policy(meta), model, budget))
    print(f"Shipped scorers under {root} (kvjax.load_scorers(folder) loads one; its budget is the export's "
          f"default, a policy built from it can change it):\n")
    print(_table(rows))
    return 0
