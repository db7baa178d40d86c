"""The evaluation config schema (``eval.py --config X.yaml --set a.b=v``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class EvalConfig:
    mode: Literal["quality", "bench"] = "quality"
    model: str = "assets/testbed-teacher"          # a Hugging Face folder
    out_dir: str = "runs/eval"
    testbed: dict[str, Any] = field(default_factory=dict)   # TestbedConfig fields (length, ...)
    split: Literal["valid", "test"] = "test"
    num_problems: int = 500
    policies: list[str] = field(default_factory=lambda: ["dense", "streaming_llm", "oracle"])
    compressions: list[float] = field(default_factory=lambda: [0.75])
    window: int | None = None                      # recent-window tokens at every compression (default: budget / 16)
    batch_size: int = 16
    answers: bool = True                           # also free-generation answer accuracy
    scorers: dict[str, str] = field(default_factory=dict)  # policy label -> exported scorer folder
    students: dict[str, str] = field(default_factory=dict)  # policy label -> its distilled model (HF folder)
    # diagnostic rows: label -> {policy: a heuristic or oracle, plus EvictionConfig fields}, e.g.
    # {policy: oracle_peak, budgets: shares, head_shares: [[100, 100], [1, 1]]} (layer 0 keeps its context)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    length_factors: list[int] = field(default_factory=lambda: [1])  # also at 2x, 4x the testbed length
    resume: bool = True                            # reuse out_dir's per-problem results of the same evaluation
    plots: bool = True                             # recall per head and eviction-map PNGs
    # mode bench: jitted decode latency / memory, dense vs KVpop's bounded cache vs transformers
    bench_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 32768])
    bench_batches: list[int] = field(default_factory=lambda: [1, 8])
    bench_budget: int = 2048                       # KVpop budget per KV head (4 sinks + budget/16 window)
    bench_steps: int = 16                          # decode steps timed at each length
    bench_repeats: int = 3
    bench_preset: str | None = None                # e.g. qwen3-8b shapes on a GPU/TPU; default: the bench model
    bench_model: str | None = None                 # an HF folder to time instead (e.g. SmolLM2 from make real-model)
    bench_transformers: bool = True                # also time transformers (PyTorch, CPU) with the same weights

    def __post_init__(self):
        if self.num_problems < 1:
            raise ValueError(f"num_problems must be >= 1, got {self.num_problems}")
        from kvjax.eviction.policies import REGISTRY

        unknown = [p for p in self.policies if p != "dense" and p not in REGISTRY and p not in self.scorers
                   and p not in self.variants]
        if unknown:
            raise ValueError(f"policies: unknown policy {unknown[0]!r}; known: dense, {', '.join(sorted(REGISTRY))}, "
                             f"or a label of `scorers` ({', '.join(sorted(self.scorers)) or 'none given'})")
        learned = {n for n, cls in REGISTRY.items() if hasattr(cls, "export_kind")}   # weights from export_scorers
        heuristics = set(REGISTRY) - learned
        weightless = [p for p in self.policies if p in learned and p not in self.scorers]
        if weightless:
            raise ValueError(f"policies: {weightless[0]!r} is a learned policy; give its exported weights in "
                             f"`scorers` ({weightless[0]}: folder written by kvjax.export_scorers)")
        clash = sorted(set(self.scorers) & (heuristics | {"dense"}))
        if clash:
            raise ValueError(f"scorers: label {clash[0]!r} is a heuristic policy's name; pick another label")
        for label, v in self.variants.items():
            check_variant(label, v, taken=set(REGISTRY) | set(self.scorers) | {"dense"}, learned=learned)
        stray = sorted(set(self.students) - set(self.scorers))
        if stray:
            raise ValueError(f"students: label {stray[0]!r} has no entry in `scorers`")
        if not self.length_factors or any(f < 1 for f in self.length_factors):
            raise ValueError(f"length_factors must be positive integers, got {self.length_factors}")
        for c in self.compressions:
            if not 0.0 <= c < 1.0:
                raise ValueError(f"compressions: each must be in [0, 1), got {c}")
        if self.window is not None:
            if self.window < 1:
                raise ValueError(f"window must be >= 1 (or null for budget / 16), got {self.window}")
            if self.mode == "quality":        # every budget of the run, before any problem is evaluated
                from kvjax.data import TestbedConfig
                from kvjax.evaluation.budgets import budget_for

                length = TestbedConfig(**self.testbed).length
                for f in self.length_factors:
                    for c in self.compressions:
                        try:
                            budget_for(length * f, c, window=self.window)
                        except ValueError as e:
                            raise ValueError(f"window: {e}") from None
        if any(n < 1 for n in self.bench_lengths) or any(b < 1 for b in self.bench_batches):
            raise ValueError("bench_lengths and bench_batches must be positive")
        if self.bench_model is not None and self.bench_preset is not None:
            raise ValueError("set bench_model (an HF folder) or bench_preset (random weights of a preset), not both")
        if self.bench_budget < 6 or self.bench_steps < 1 or self.bench_repeats < 1:
            raise ValueError("bench_budget must be >= 6, bench_steps and bench_repeats >= 1")


VARIANT_FIELDS = ("budgets", "head_norm", "head_shares", "k_max", "pyramid_beta", "adakv_alpha", "obs_window", "pool")


def check_variant(label: str, v: dict, *, taken: set, learned: set) -> None:
    """A ``variants`` entry: a new label, a weightless base policy and EvictionConfig fields
    other than the budget itself (sinks, window and topk follow the compression)."""
    from kvjax.eviction.config import EvictionConfig

    if label in taken:
        raise ValueError(f"variants: label {label!r} is already a policy's name; pick another label")
    if not isinstance(v, dict) or "policy" not in v:
        raise ValueError(f"variants.{label}: needs `policy` (the heuristic or oracle it varies)")
    if v["policy"] in learned or v["policy"] not in taken - {"dense"}:
        raise ValueError(f"variants.{label}.policy: {v['policy']!r} is not a heuristic or oracle policy")
    bad = sorted(set(v) - {"policy", *VARIANT_FIELDS})
    if bad:
        raise ValueError(f"variants.{label}: {bad[0]!r} cannot be set here; allowed: policy, {', '.join(VARIANT_FIELDS)}")
    try:
        EvictionConfig(sinks=4, window=8, topk=1, **{k: x for k, x in v.items() if k not in ("policy", "k_max")})
    except (TypeError, ValueError) as e:
        raise ValueError(f"variants.{label}: {e}") from None
