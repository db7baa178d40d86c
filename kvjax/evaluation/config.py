"""The evaluation config schema (``eval.py --config X.yaml --set a.b=v``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class EvalConfig:
    mode: Literal["quality"] = "quality"
    model: str = "assets/testbed-teacher"          # a Hugging Face folder
    out_dir: str = "runs/eval"
    testbed: dict[str, Any] = field(default_factory=dict)   # TestbedConfig fields (length, ...)
    split: Literal["valid", "test"] = "test"
    num_problems: int = 500
    policies: list[str] = field(default_factory=lambda: ["dense", "streaming_llm", "oracle"])
    compressions: list[float] = field(default_factory=lambda: [0.75])
    batch_size: int = 16
    answers: bool = True                           # also free-generation answer accuracy

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
