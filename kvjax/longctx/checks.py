"""Checks of a long-context config made before any work (:class:`~kvjax.longctx.run.LongCtxConfig`
checks its own values): the policy names, and each ``learned`` folder against its label; and
what a learned row's stored records depend on besides its scorer (:func:`learned_rule`)."""

from __future__ import annotations

from pathlib import Path


def check_policy_names(policies, learned, oracles) -> None:
    """Every name in ``policies`` a heuristic or one of the ``oracles`` the runner builds (learned
    policies come with their folders under ``learned:``), every ``learned`` label new."""
    from kvjax.eviction.policies import REGISTRY

    runnable = ["dense", *(n for n in REGISTRY if getattr(REGISTRY[n], "export_kind", None) is None
                           and (not n.startswith("oracle") or n in oracles))]
    for name in policies:
        if name in REGISTRY and getattr(REGISTRY[name], "export_kind", None) is not None:
            raise ValueError(f"policies: {name!r} is a learned policy; list it under learned: as "
                             f"'{name}: <its exported folder>'")
        if name not in runnable:
            raise ValueError(f"policies: unknown policy {name!r}; known: {', '.join(runnable)} "
                             "(learned policies go under learned:)")
    for label in learned:
        if label in runnable:
            raise ValueError(f"learned: label {label!r} is a built-in policy's name; give the learned row another label")


def check_variants(variants: dict, learned: dict, prefill: str) -> None:
    """Each ``variants`` row: a new label over a heuristic or oracle with EvictionConfig fields
    (:func:`kvjax.evaluation.config.check_variant`); a shared budget needs prefill compression."""
    from kvjax.evaluation.config import check_variant
    from kvjax.eviction.policies import REGISTRY

    learned_names = {n for n, c in REGISTRY.items() if getattr(c, "export_kind", None) is not None}
    for label, v in variants.items():
        check_variant(label, v, taken=set(REGISTRY) | set(learned) | {"dense"}, learned=learned_names)
        check_shared_budget(f"variants.{label}: budgets", v.get("budgets"), prefill)


def check_shared_budget(where: str, rule, prefill: str) -> None:
    """A budget shared across heads (``global``, ``layer``) runs in prefill compression only."""
    if rule in ("global", "layer") and prefill != "compressed":
        raise ValueError(f"{where} {rule!r} shares one top-k across heads, which runs in prefill compression "
                         f"(prefill: compressed), not prefill: {prefill}")


def exported_policy(folder) -> str | None:
    """The policy an exported folder holds, from its ``scorer_config.json`` (``policy``; older exports:
    inferred from ``scorer`` and ``lkv_budgets`` as :func:`kvjax.load_scorers` does)."""
    import json

    meta = json.loads((Path(folder) / "scorer_config.json").read_text())
    kind = meta.get("scorer")
    return meta.get("policy") or {"mlp": "kvpop_mlp", "lkv": "lkv", "duo": "duo_attention", "dms": "dms",
                                  "mlstm": "kvpop_mlstm" if meta.get("lkv_budgets") is None else "lkv_kvpop_mlstm"
                                  }.get(kind)


def label_policy(label: str) -> str | None:
    """The learned policy a ``learned:`` label names: the longest registered learned policy the label
    is or starts with (``kvpop_mlstm_adakv``: ``kvpop_mlstm``); None for a free label (``mine``)."""
    from kvjax.eviction.policies import REGISTRY

    names = [n for n in REGISTRY if getattr(REGISTRY[n], "export_kind", None) is not None
             and (label == n or label.startswith(n + "_"))]
    return max(names, key=len) if names else None


def check_learned(cfg) -> None:
    """Each ``learned`` folder exists, holds an export, and holds the policy its label names (a row
    labelled ``lkv`` must not be a KVpop MLP). Raises FileNotFoundError / ValueError naming the label."""
    for label, folder in cfg.learned.items():
        d = Path(folder).expanduser()
        if not d.is_dir():
            raise FileNotFoundError(f"learned: {label}: {folder} does not exist")
        missing = [f for f in ("scorer_config.json", "scorers.safetensors") if not (d / f).is_file()]
        if missing:
            raise FileNotFoundError(f"learned: {label}: {folder} holds no {missing[0]} (not a folder written by "
                                    "kvjax.export_scorers)")
        try:
            held = exported_policy(d)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"learned: {label}: {d / 'scorer_config.json'}: not valid JSON: {e}") from None
        named = label_policy(label)
        if named is not None and held != named:
            raise ValueError(f"learned: label {label!r} names policy {named}, but {folder} holds "
                             f"{'a ' + held if held else 'an unknown'} export (scorer_config.json); point the label "
                             f"at a {named} export or rename it (e.g. {held or 'mine'})")


def learned_rule(rule: str | None, policy) -> dict:
    """What a learned row's records depend on besides its scorer: its budget rule (``None``: the
    scorer's own), and under a shared budget how the rule compares heads
    (:func:`kvjax.eviction.prompt_compressed.resolved_head_norm`; a centred scorer is z-scored)."""
    from kvjax.eviction.prompt_compressed import resolved_head_norm

    if rule is None:
        return {}
    shared = rule in ("global", "layer")
    return {"budgets": rule, **({"head_norm": resolved_head_norm(policy)} if shared else {})}
