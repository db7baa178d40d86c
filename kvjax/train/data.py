"""Input pipelines as grain ``MapDataset``s: random access by batch index, so the data
position is just the step (exact resume), and each process reads its own rows.

Sources:
- ``testbed``: the synthetic reasoning-trace generator (``kvjax.data``), one problem
  per index of the ``train`` split.
- ``tokens``: a JSONL file, one ``{"tokens": [int, ...]}`` object per line; each
  sequence is truncated or padded (pad id 0, no loss) to ``seq_len``; shuffled by seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from kvjax.data import TestbedConfig, collate, generate_problem
from kvjax.train.config import DataSection, Phase


class TestbedSource:
    """Random-access problems of one split, collated to ``seq_len`` (grain data source)."""

    def __init__(self, cfg: TestbedConfig, split: str, seq_len: int, size: int = 2**31 - 1):
        self.cfg, self.split, self.seq_len, self.size = cfg, split, seq_len, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        b = collate([generate_problem(self.cfg, self.split, int(i))], self.seq_len)
        return {k: v[0] for k, v in b.items()}


class JsonlTokenSource:
    """One JSONL line = one sequence of token ids; byte offsets indexed once. ``teacher``: the
    teacher's cached ``(logp, idx)`` ``[rows, S, K]`` (``kvjax.train.teacher_cache``), returned
    with each row as ``teacher_logp`` / ``teacher_idx``."""

    def __init__(self, path: str, seq_len: int, teacher: tuple[np.ndarray, np.ndarray] | None = None):
        self.path, self.seq_len, self.teacher = Path(path), seq_len, teacher
        if not self.path.exists():
            raise FileNotFoundError(f"data.path: token file {self.path} does not exist")
        self.offsets = []
        with open(self.path, "rb") as f:
            pos = 0
            for line in f:
                if line.strip():
                    self.offsets.append(pos)
                pos += len(line)
        if not self.offsets:
            raise ValueError(f"data.path: {self.path} holds no sequences")

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> dict:
        with open(self.path, "rb") as f:
            f.seek(self.offsets[int(i)])
            line = f.readline()
        try:
            ids = np.asarray(json.loads(line)["tokens"], np.int32)[: self.seq_len]
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{self.path}: line {int(i) + 1} is not a {{'tokens': [...]}} object ({e})") from None
        tokens = np.zeros(self.seq_len, np.int32)
        tokens[: len(ids)] = ids
        mask = np.zeros(self.seq_len, bool)
        mask[1: len(ids)] = True
        row = {"tokens": tokens, "loss_mask": mask}
        if self.teacher is not None:
            row["teacher_logp"], row["teacher_idx"] = self.teacher[0][int(i)], self.teacher[1][int(i)]
        return row


def testbed_config(data: DataSection, phase: Phase | None = None) -> TestbedConfig:
    knobs = {**data.testbed, **{k: v for k, v in (phase.data if phase else {}).items() if k != "seq_len"}}
    return TestbedConfig(**knobs)


def phase_seq_len(data: DataSection, phase: Phase | None) -> int:
    return int((phase.data if phase else {}).get("seq_len", data.seq_len))


def make_dataset(data: DataSection, phase: Phase | None, seed: int, teacher=None):
    """Batched ``grain.MapDataset`` of this process's rows: ``ds[i]`` is the i-th batch of the phase.

    grain is imported here, not at module import: only the training data pipeline needs it
    (the device check runs where grain is not installed). ``teacher``: the cached teacher
    top-k of ``data.path``'s rows (``kvjax.train.teacher_cache.load_teacher_cache``)."""
    import grain

    seq_len = phase_seq_len(data, phase)
    if data.source == "testbed":
        ds = grain.MapDataset.source(TestbedSource(testbed_config(data, phase), "train", seq_len))
    else:
        ds = grain.MapDataset.source(JsonlTokenSource(data.path, seq_len, teacher)).shuffle(seed=seed).repeat()
    nproc, pid = jax.process_count(), jax.process_index()
    batch_size = phase.batch_size if phase is not None and phase.batch_size else data.batch_size
    if batch_size % nproc:
        raise ValueError(f"batch size {batch_size} must be divisible by the {nproc} processes")
    if nproc > 1:
        ds = ds[pid::nproc]
    return ds.batch(batch_size // nproc, drop_remainder=True)
