"""What a bounded cache keeps on the real model's own traces: the KVpop seed's Figures 6 and 7.

Each held-out trace (cut to ``crop`` tokens) is prefilled through a policy's cache
(:func:`~kvjax.evaluation.retention.kept_positions`: bounded throughout for static-priority
policies; SnapKV, H2O and TOVA prefill densely and select when the trace ends), and the kept
set after the last token is compared with the hindsight oracle's (mean future attention,
the seed's Eq. 15-16, same budget):

- **Figure 7** (``figure7_recall.png``): top-k retention recall per layer and KV head,
  ``|oracle's long-range kept ∩ policy's kept| / |oracle's long-range kept|``, averaged over
  traces; one box per layer over its heads, one panel per policy.
- **Figure 6** (``figure6_eviction_map.png``): one trace's last ``map_last`` tokens as text;
  rows are layers, colour is how many KV heads keep the token.

Records are per (policy, trace) in a :class:`~kvjax.evaluation.results_store.ResultsStore`
(resumable). ``python -m kvjax.evaluation.trace_retention --config configs/retention-smollm2.yaml``
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvjax.eviction.config import kept_slots


@dataclass(frozen=True)
class RetentionConfig:
    traces: list[str] = field(default_factory=lambda: ["assets/smollm2-traces/valid.jsonl"])
    model_dir: str | None = None           # HF folder; default: SmolLM2 via kvjax.real_model
    out_dir: str = "runs/retention/smollm2"
    policies: list[str] = field(default_factory=lambda: ["streaming_llm", "random", "knorm", "snapkv", "h2o",
                                                         "tova"])
    learned: dict[str, str] = field(default_factory=dict)   # label -> exported scorer folder
    crop: int = 768                        # traces shorter than this are skipped
    compression: float = 0.75
    sinks: int = 4
    window: int = 32
    batch_size: int = 8
    max_traces: int = 16                   # the first N traces that reach ``crop`` (0: all)
    map_trace: int = 0                     # Figure 6 shows this one (index among the selected traces)
    map_last: int = 112                    # ... its last tokens (the seed shows 112)
    map_policies: list[str] = field(default_factory=list)   # default: oracle, snapkv and the learned ones

    def __post_init__(self):
        if not 0.0 < self.compression < 1.0:
            raise ValueError(f"compression: {self.compression} is not in (0, 1)")
        if kept_slots(self.compression, self.crop) <= self.sinks + self.window:
            raise ValueError(f"compression {self.compression} of a {self.crop}-token crop leaves no long-range slot")
        if min(self.batch_size, self.map_last) < 1 or self.max_traces < 0:
            raise ValueError("batch_size and map_last must be >= 1, max_traces >= 0")


def budget(cfg: RetentionConfig):
    from kvjax.evaluation.budgets import fixed_window_budget

    return fixed_window_budget(cfg.crop, cfg.compression, sinks=cfg.sinks, window=cfg.window)



def run_retention(cfg: RetentionConfig, *, model=None, progress: bool = True) -> tuple[dict, list[dict]]:
    """Record every (policy, trace) not yet stored; returns (:func:`summarize` of them, the records)."""
    from tqdm import tqdm

    import kvjax
    from kvjax.evaluation.oracle import oracle_priorities
    from kvjax.evaluation.policy_rows import build_policy
    from kvjax.evaluation.results_store import ResultsStore, load_learned, record_key
    from kvjax.evaluation.retention import kept_positions, retention_recall
    from kvjax.evaluation.trace_fidelity import load_traces
    from kvjax.eviction.policies import make_policy
    from kvjax.export import config_hash
    from kvjax.real_model import ensure_model

    model = model or kvjax.load_hf(Path(cfg.model_dir) if cfg.model_dir else ensure_model())
    rows = [r for r in load_traces(cfg.traces) if len(r["tokens"]) >= cfg.crop]
    rows = rows[: cfg.max_traces] if cfg.max_traces else rows
    if not rows:
        raise ValueError(f"no trace in {cfg.traces} reaches crop={cfg.crop} tokens")
    if cfg.map_trace >= len(rows):
        raise ValueError(f"map_trace={cfg.map_trace}, but only {len(rows)} traces reach {cfg.crop} tokens")
    learned, digests = load_learned(cfg.learned, model)
    if any(p.startswith("oracle") for p in cfg.policies):
        raise ValueError("policies: the oracle is the reference and always runs; list only the others")
    names = list(cfg.policies) + list(learned) + ["oracle"]
    ev = budget(cfg)
    run = {"model": config_hash(model.config), "metric": "retention-v1", "crop": cfg.crop, "map_trace": cfg.map_trace,
           "sinks": cfg.sinks, "window": cfg.window,
           "traces": [hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16] for p in cfg.traces]}
    store = ResultsStore(cfg.out_dir, run, policies=digests)
    try:
        batches = [list(range(j, min(j + cfg.batch_size, len(rows)))) for j in range(0, len(rows), cfg.batch_size)]
        bar = tqdm(total=len(batches) * len(names), desc="retention", unit="batch", disable=not progress)
        for idx in batches:
            tokens = np.asarray([rows[i]["tokens"][: cfg.crop] for i in idx], np.int32)
            lengths = np.full(len(idx), cfg.crop, np.int32)
            oracle_lr = None
            for name in names:
                keys = [record_key(cfg.crop, cfg.compression, name, i) for i in idx]
                bar.update(1)
                if store.has(keys):
                    continue
                if oracle_lr is None:
                    pri = oracle_priorities(model, tokens, cfg.window, "mean")
                    _, oracle_lr = kept_positions(model, tokens, lengths, make_policy("oracle", ev, params=pri))
                pol = build_policy(name, ev, learned, context=cfg.crop, oracle=lambda kind: pri)
                every, _ = kept_positions(model, tokens, lengths, pol)            # [L, B, K, slots]
                rec = retention_recall(every, oracle_lr, cfg.crop)                # [L, B, K]
                store.add([{"key": k, "id": rows[i]["id"], "policy": name,
                            "recall": np.where(np.isnan(rec[:, b]), -1.0, rec[:, b]).round(4).tolist(),
                            **({"kept": every[:, b].tolist(), "tokens": tokens[b].tolist()}
                               if i == cfg.map_trace else {})}
                           for b, (k, i) in enumerate(zip(keys, idx))])
        bar.close()
        wanted = {record_key(cfg.crop, cfg.compression, name, i) for name in names for i in range(len(rows))}
        # this config's records only (the folder may hold other compressions or more traces)
        records = [r for k, r in store.records.items() if k in wanted]
        return summarize(records, names), records
    finally:
        store.close()


def summarize(records: list[dict], names) -> dict:
    """``{policy: {recall, recall_se (over traces), n, by_head [L][K]}}``."""
    out = {}
    for p in names:
        rs = [np.where(np.asarray(r["recall"]) < 0, np.nan, np.asarray(r["recall"], float))
              for r in records if r["policy"] == p]
        if not rs:
            continue
        grid = np.stack(rs)                                   # [N, L, K]
        with np.errstate(invalid="ignore"):
            per_trace = np.nanmean(grid.reshape(len(rs), -1), 1)
        per_trace = per_trace[np.isfinite(per_trace)]
        if not len(per_trace):
            continue
        se = float(per_trace.std(ddof=1) / np.sqrt(len(per_trace))) if len(per_trace) > 1 else float("nan")
        out[p] = {"recall": float(per_trace.mean()), "recall_se": se, "n": len(per_trace),
                  "by_head": np.round(np.nanmean(grid, 0), 4).tolist()}
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_recall_by_layer(summary: dict, path, title: str) -> Path:
    """Figure 7: per policy, one box per layer over its KV heads' mean recall."""
    plt = _plt()
    names = [p for p in summary if p != "oracle"]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.7 * len(names) + 0.8), sharex=True, squeeze=False)
    for ax, p in zip(axes[:, 0], names):
        grid = np.asarray(summary[p]["by_head"], float)       # [L, K]
        ax.boxplot([g[np.isfinite(g)] for g in grid], positions=range(len(grid)), widths=0.6, showfliers=True)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel(f"{p}\n{summary[p]['recall']:.2f}", fontsize=8, rotation=0, ha="right", va="center")
        ax.grid(axis="y", alpha=0.3)
    axes[-1, 0].set_xticks(range(len(grid)), [str(i) for i in range(len(grid))], fontsize=7)
    axes[-1, 0].set_xlabel("layer (box: its KV heads)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def token_labels(tok, ids) -> list[str]:
    """Printable token strings: GPT-2 byte markers turned into a space / a return sign."""
    out = []
    for t in tok.convert_ids_to_tokens([int(i) for i in ids]):
        s = t.replace("Ġ", "·").replace("Ċ", "⏎").replace("ĉ", "⇥")
        out.append(s if len(s) <= 14 else s[:13] + "…")
    return out


def plot_eviction_map(records: dict[str, dict], tok, path, last: int, title: str) -> Path:
    """Figure 6: per policy, rows = layers, columns = the trace's last ``last`` tokens (as text),
    colour = how many KV heads keep the token after the trace's last token."""
    from kvjax.evaluation.retention import eviction_map

    plt = _plt()
    names = list(records)
    tokens = np.asarray(records[names[0]]["tokens"])
    lo = max(0, len(tokens) - last)
    words = token_labels(tok, tokens[lo:])
    fig, axes = plt.subplots(len(names), 1, figsize=(min(0.16 * len(words) + 2, 26), 2.2 * len(names) + 1.4),
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        pos = np.asarray(records[name]["kept"])[:, None]      # [L, 1, K, slots]
        m = eviction_map(pos, 0, len(tokens))[:, lo:]          # [L, tokens]
        im = ax.imshow(m, vmin=0, vmax=pos.shape[2], cmap="Blues", aspect="auto", interpolation="nearest")
        ax.set_yticks(range(0, m.shape[0], 5), [f"L{l}" for l in range(0, m.shape[0], 5)], fontsize=6)
        ax.set_ylabel(name, fontsize=8)
        ax.set_xticks(range(len(words)), words, fontsize=5, rotation=90)
    fig.colorbar(im, ax=axes[:, 0].tolist(), fraction=0.02, label="KV heads keeping the token")
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def write_figures(cfg: RetentionConfig, summary: dict, records: list[dict], tok) -> list[Path]:
    out = Path(cfg.out_dir)
    pct = f"{cfg.compression:.0%} compression, {cfg.crop}-token traces, N={max(s['n'] for s in summary.values())}"
    paths = [plot_recall_by_layer(summary, out / "figure7_recall.png",
                                  f"top-k retention recall vs the mean-future-attention oracle per layer ({pct})")]
    map_id = records and next((r["id"] for r in records if "kept" in r), None)
    maps = {r["policy"]: r for r in records if "kept" in r and r["id"] == map_id}
    want = cfg.map_policies or ["oracle", "snapkv", *cfg.learned]
    chosen = {p: maps[p] for p in want if p in maps}
    if chosen:
        paths.append(plot_eviction_map(chosen, tok, out / "figure6_eviction_map.png", cfg.map_last,
                                       f"KV heads keeping each of the last {cfg.map_last} tokens of trace "
                                       f"{next(iter(chosen.values()))['id']} ({pct})"))
    return paths


def markdown(summary: dict) -> str:
    lines = ["| policy | top-k retention recall vs oracle |", "|---|---|"]
    for p, s in summary.items():
        lines.append(f"| {p} (N={s['n']}) | {s['recall']:.3f} ± {s['recall_se']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import json
    import sys

    import transformers

    from kvjax.configio import cli_config
    from kvjax.real_model import ensure_model

    cfg, _ = cli_config(RetentionConfig, "python -m kvjax.evaluation.trace_retention", __doc__, argv,
                        set_example="max_traces=4", examples=(
                            "python -m kvjax.evaluation.trace_retention --config configs/retention-smollm2.yaml "
                            "--set max_traces=4 --set out_dir=runs/retention/try",))
    try:
        summary, records = run_retention(cfg)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"python -m kvjax.evaluation.trace_retention: {e}", file=sys.stderr)
        return 1
    tok = transformers.AutoTokenizer.from_pretrained(cfg.model_dir or ensure_model())
    out = Path(cfg.out_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    md = markdown(summary)
    (out / "table.md").write_text(md + "\n")
    print(md)
    for p in write_figures(cfg, summary, records, tok):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
