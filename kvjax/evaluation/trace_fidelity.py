"""Trace fidelity: how closely a bounded cache reproduces the dense model on its own traces.

The seed's token-accuracy metric, on held-out self-generated traces
(:mod:`kvjax.traces`): each trace is teacher-forced through the model with the policy's
cache *bounded throughout* (KVpop's setting: every query, prompt included, sees only its
kept set of ``sinks + window + topk`` tokens per head), and at every position of the
assistant's tokens we compare the next-token distribution with the dense model's:

- ``top1``: the share of positions whose argmax equals the dense argmax;
- ``kl``: the mean ``KL(dense || policy)`` per position;
- ``nll``: the policy's mean negative log-likelihood of the trace's next token (``ppl`` =
  ``exp(nll)``, the held-out perplexity; policy ``dense`` gives the model's own).

``adapted``: backbones trained to their bounded cache (``distill_kvpop``'s ``save_hf`` folder and
its exported scorers) are measured against the *original* dense model: row ``label`` runs the
adapted backbone with its scorers, ``label/dense`` the adapted backbone dense (what adaptation
costs when the cache is not bounded), ``label/P`` each of ``adapted_policies`` on it.

Budgets: a trace is cut to the longest of ``crops`` it reaches (few compiled shapes,
and the compression is exact), and ``sinks + window + topk = round((1 - c) * crop)``.
Static-priority policies (StreamingLLM, K-norm, random, the oracles, KVpop) run one
keep-rule-masked pass; attention-statistic policies (SnapKV, H2O, TOVA) run token by
token through the decode path. Results are per trace in a :class:`ResultsStore`
(resumable); :func:`table` aggregates them with standard errors over traces.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.evaluation.policy_rows import ORACLES
from kvjax.eviction.config import kept_slots

HEURISTICS = ("streaming_llm", "knorm", "random", "snapkv", "h2o", "tova")


@dataclass(frozen=True)
class FidelityConfig:
    traces: list[str] = field(default_factory=lambda: ["assets/smollm2-traces/valid.jsonl",
                                                        "assets/smollm2-traces/test.jsonl"])
    model_dir: str | None = None           # HF folder; default: SmolLM2 via kvjax.real_model
    out_dir: str = "runs/fidelity/smollm2"
    policies: list[str] = field(default_factory=lambda: ["streaming_llm", "knorm", "snapkv", "h2o", "tova",
                                                         "oracle"])
    learned: dict[str, str] = field(default_factory=dict)   # label -> exported scorer folder
    adapted: dict[str, dict[str, str]] = field(default_factory=dict)  # label -> {model: HF folder, scorers: folder}
    adapted_policies: list[str] = field(default_factory=list)  # also run on every adapted backbone (label/P)
    compressions: list[float] = field(default_factory=lambda: [0.75, 0.88])
    crops: list[int] = field(default_factory=lambda: [512, 768, 1024])
    sinks: int = 4
    window: int = 32
    batch_size: int = 8
    max_traces: int = 0                    # the first N traces (0: all)

    def __post_init__(self):
        for label, entry in self.adapted.items():
            bad = sorted(set(entry) - {"model", "scorers"})
            if bad or "model" not in entry:
                raise ValueError(f"adapted.{label}: give {{model: HF folder, scorers: exported scorer folder}}"
                                 + (f"; unknown key {bad[0]!r}" if bad else "; model is missing"))
        oracles = [p for p in self.adapted_policies if p in ORACLES]
        if oracles:
            raise ValueError(f"adapted_policies: {oracles[0]} reads the original model's attention; "
                             f"it cannot run on an adapted backbone")
        for c in self.compressions:
            if not 0.0 < c < 1.0:
                raise ValueError(f"compressions: {c} is not in (0, 1)")
        for c in self.compressions:
            for n in self.crops:
                if kept_slots(c, n) < self.sinks + self.window + 1:
                    raise ValueError(f"compression {c} of a {n}-token crop leaves {kept_slots(c, n)} slots, "
                                     f"not more than sinks + window = {self.sinks + self.window}; lower the window")


def budget(cfg: FidelityConfig, crop: int, compression: float):
    from kvjax.evaluation.budgets import fixed_window_budget

    return fixed_window_budget(crop, compression, sinks=cfg.sinks, window=cfg.window)


def load_traces(paths, max_traces: int = 0) -> list[dict]:
    rows = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"traces: {p} does not exist; run python -m kvjax.traces first")
        rows += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return rows[:max_traces] if max_traces else rows


def crop_of(n: int, crops) -> int | None:
    fit = [c for c in sorted(crops) if c <= n]
    return fit[-1] if fit else None


def _compare(dense_BSV, other_BSV, starts_B, tokens_BS):
    """Per row: (top-1 agreements, KL sum, next-token NLL sum, positions) over positions ``>= start``
    (each predicting the next token)."""
    p = jax.nn.log_softmax(dense_BSV, -1)
    q = jax.nn.log_softmax(other_BSV, -1)
    kl = jnp.sum(jnp.exp(p) * (p - q), -1)                                   # [B, S]
    agree = jnp.argmax(dense_BSV, -1) == jnp.argmax(other_BSV, -1)
    nxt = jnp.concatenate([jnp.asarray(tokens_BS)[:, 1:], jnp.zeros_like(jnp.asarray(tokens_BS)[:, :1])], 1)
    nll = -jnp.take_along_axis(q, nxt[..., None], -1)[..., 0]
    S = dense_BSV.shape[1]
    m = (jnp.arange(S)[None, :] >= starts_B[:, None]) & (jnp.arange(S)[None, :] < S - 1)
    return (np.asarray(jnp.sum(agree & m, 1)), np.asarray(jnp.sum(jnp.where(m, kl, 0.0), 1)),
            np.asarray(jnp.sum(jnp.where(m, nll, 0.0), 1)), np.asarray(jnp.sum(m, 1)))


def run_fidelity(cfg: FidelityConfig, *, model=None, progress: bool = True) -> dict:
    """Evaluate every (crop, compression, policy, trace) not yet stored; returns :func:`table`."""
    from tqdm import tqdm

    import kvjax
    from kvjax.evaluation.oracle import oracle_priorities
    from kvjax.evaluation.policy_rows import build_policy
    from kvjax.evaluation.results_store import ResultsStore, folder_digest, load_learned, record_key
    from kvjax.eviction.forced import sparse_logits, stepwise_logits
    from kvjax.export import config_hash
    from kvjax.real_model import ensure_model

    folder = Path(cfg.model_dir) if cfg.model_dir else ensure_model()
    model = model or kvjax.load_hf(folder)
    rows = load_traces(cfg.traces, cfg.max_traces)
    learned, digests = load_learned(cfg.learned, model)
    # name -> (model it runs on, name of its policy); adapted backbones are judged against the original
    runs_on = {name: (model, name) for name in list(cfg.policies) + list(learned)}
    for label, entry in cfg.adapted.items():
        m = kvjax.load_hf(entry["model"])
        own = {"model": folder_digest(entry["model"])}
        if "scorers" in entry:
            learned[label] = kvjax.load_scorers(entry["scorers"], model=m)
            runs_on[label] = (m, label)
            digests[label] = {**own, "scorer": folder_digest(entry["scorers"])}
        for p in ["dense", *cfg.adapted_policies]:
            runs_on[f"{label}/{p}"] = (m, p)
            digests[f"{label}/{p}"] = own
    names = list(runs_on)
    run = {"model": config_hash(model.config), "traces": [hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16]
                                                          for p in cfg.traces],
           "sinks": cfg.sinks, "window": cfg.window, "crops": sorted(cfg.crops), "metric": "fidelity-v1"}
    store = ResultsStore(cfg.out_dir, run, policies=digests)
    try:
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            c = crop_of(len(r["tokens"]), cfg.crops)
            if c is not None:
                groups.setdefault(c, []).append(i)
        work = [(crop, idx[j:j + cfg.batch_size]) for crop, idx in sorted(groups.items())
                for j in range(0, len(idx), cfg.batch_size)]
        total = len(work) * len(cfg.compressions) * len(names)
        bar = tqdm(total=total, desc="fidelity", unit="batch", disable=not progress)
        for crop, idx in work:
            tokens = np.asarray([rows[i]["tokens"][:crop] for i in idx], np.int32)
            starts = jnp.asarray([min(int(rows[i].get("prompt_len", 0)), crop - 1) for i in idx])
            dense, oracles = None, {}

            def oracle(kind):
                if kind not in oracles:
                    oracles[kind] = oracle_priorities(model, tokens, cfg.window, kind)
                return oracles[kind]

            for comp in cfg.compressions:
                ev = budget(cfg, crop, comp)
                for name in names:
                    keys = [record_key(crop, comp, name, i) for i in idx]
                    bar.update(1)
                    if store.has(keys):
                        continue
                    if dense is None:
                        dense = kvjax.forward(model, tokens)
                    m_run, p_name = runs_on[name]
                    pol = build_policy(p_name, ev, learned, context=crop, oracle=oracle)
                    t0 = time.time()
                    if pol is None:
                        logits = dense if m_run is model else kvjax.forward(m_run, tokens)
                    elif pol.static:
                        logits = sparse_logits(m_run, tokens, pol)
                    else:
                        logits = stepwise_logits(m_run, tokens, pol)
                    agree, kl, nll, n = _compare(dense, logits, starts, tokens)
                    sec = (time.time() - t0) / len(idx)
                    store.add([{"key": k, "id": rows[i]["id"], "kind": rows[i].get("kind"), "crop": crop,
                                "compression": comp, "policy": name, "top1": [int(a), int(m)], "kl": float(s),
                                "nll": float(ll), "seconds": round(sec, 2)}
                               for k, i, a, s, ll, m in zip(keys, idx, agree, kl, nll, n)])
        bar.close()
        return table(list(store.records.values()), names, cfg.compressions)
    finally:
        store.close()


def table(records: list[dict], policies, compressions) -> dict:
    """``{compression: {policy: {top1, top1_se, kl, kl_se, n}}}``: means over traces of each
    trace's top-1 agreement and mean KL, with standard errors over traces."""
    out: dict = {}
    for c in compressions:
        out[c] = {}
        for p in policies:
            rs = [r for r in records if r["policy"] == p and math.isclose(r["compression"], c) and r["top1"][1] > 0]
            if not rs:
                continue
            top1 = np.asarray([r["top1"][0] / r["top1"][1] for r in rs])
            kl = np.asarray([r["kl"] / r["top1"][1] for r in rs])
            se = lambda a: float(a.std(ddof=1) / np.sqrt(len(a))) if len(a) > 1 else float("nan")   # noqa: E731
            out[c][p] = {"top1": float(top1.mean()), "top1_se": se(top1), "kl": float(kl.mean()), "kl_se": se(kl),
                         "n": len(rs)}
            if all("nll" in r for r in rs):     # records written before the nll field have none
                nll = np.asarray([r["nll"] / r["top1"][1] for r in rs])
                out[c][p].update(nll=float(nll.mean()), nll_se=se(nll), ppl=float(np.exp(nll.mean())))
    return out


def markdown(tab: dict) -> str:
    comps = list(tab)
    policies = list(dict.fromkeys(p for c in comps for p in tab[c]))
    ppl = any("ppl" in r for c in comps for r in tab[c].values())
    per = ["top-1", "KL"] + (["ppl"] if ppl else [])
    head = "| policy | " + " | ".join(f"{m} @ {c:.0%}" for c in comps for m in per) + " |"
    lines = [head, "|---|" + "---|" * len(per) * len(comps)]
    for p in policies:
        cells = []
        for c in comps:
            r = tab[c].get(p)
            if not r:
                cells += [""] * len(per)
                continue
            cells += [f"{r['top1']:.1%} ± {r['top1_se']:.1%}", f"{r['kl']:.3f} ± {r['kl_se']:.3f}"]
            if ppl:
                cells.append(f"{r['ppl']:.3f}" if "ppl" in r else "")
        n = max((tab[c][p]["n"] for c in comps if p in tab[c]), default=0)
        lines.append(f"| {p} (N={n}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import sys

    from kvjax.configio import cli_config

    prog = "python -m kvjax.evaluation.trace_fidelity"
    cfg, _ = cli_config(FidelityConfig, prog, __doc__, argv, set_example="max_traces=4", examples=(
        f"{prog} --config configs/fidelity-smollm2.yaml --set max_traces=4 --set out_dir=runs/fidelity/try",))
    try:
        tab = run_fidelity(cfg)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"python -m kvjax.evaluation.trace_fidelity: {e}", file=sys.stderr)
        return 1
    md = markdown(tab)
    (Path(cfg.out_dir) / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
