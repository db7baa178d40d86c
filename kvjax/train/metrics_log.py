"""``metrics.jsonl`` (one JSON object per logged step), ``eval.jsonl``, and TensorBoard
event files (``tensorboardX``, a dependency) under ``tensorboard/``."""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsLog:
    def __init__(self, out_dir: Path, tensorboard: bool = True):
        self.out = Path(out_dir)
        self.t0 = time.time()
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(self.out / "tensorboard"))

    def _append(self, name: str, record: dict) -> None:
        with open(self.out / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def write(self, step: int, metrics: dict) -> None:
        self._append("metrics.jsonl", {"step": step, "wall_s": time.time() - self.t0, **metrics})
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(f"train/{k}", v, step)

    def write_eval(self, step: int, metrics: dict) -> None:
        self._append("eval.jsonl", {"step": step, "wall_s": time.time() - self.t0, **metrics})
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(f"eval/{k}", v, step)

    def close(self) -> None:
        if self.tb:
            self.tb.close()
            self.tb = None
