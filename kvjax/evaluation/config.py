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
    batch_size: int = 16
    answers: bool = True                           # also free-generation answer accuracy
    # mode bench: jitted decode latency / memory, dense vs KVpop's bounded cache vs transformers
    bench_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 32768])
    bench_batches: list[int] = field(default_factory=lambda: [1, 8])
    bench_budget: int = 2048                       # KVpop budget per KV head (4 sinks + budget/16 window)
    bench_steps: int = 16                          # decode steps timed at each length
    bench_repeats: int = 3
    bench_preset: str | None = None                # e.g. qwen3-8b shapes on a GPU/TPU; default: the bench model
    bench_transformers: bool = True                # also time transformers (PyTorch, CPU) with the same weights

    def __post_init__(self):
        if self.num_problems < 1:
            raise ValueError(f"num_problems must be >= 1, got {self.num_problems}")
        from kvjax.eviction.policies import REGISTRY

        unknown = [p for p in self.policies if p != "dense" and p not in REGISTRY]
        if unknown:
            raise ValueError(f"policies: unknown policy {unknown[0]!r}; known: dense, {', '.join(sorted(REGISTRY))}")
        for c in self.compressions:
            if not 0.0 <= c < 1.0:
                raise ValueError(f"compressions: each must be in [0, 1), got {c}")
        if any(n < 1 for n in self.bench_lengths) or any(b < 1 for b in self.bench_batches):
            raise ValueError("bench_lengths and bench_batches must be positive")
        if self.bench_budget < 6 or self.bench_steps < 1 or self.bench_repeats < 1:
            raise ValueError("bench_budget must be >= 6, bench_steps and bench_repeats >= 1")
