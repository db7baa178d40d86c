"""The one training loop of kvjax: steps, the progress bar, the metrics log, checkpoints, the
resume rule and a clean stop on SIGTERM/SIGINT.

Every trainer is a task of it: ``train.py``'s modes (:mod:`kvjax.train.loop`: pretrain,
distill_kvpop, distill_lkv), DMS's decision heads (:mod:`kvjax.dms.train`), DuoAttention's gates
(:mod:`kvjax.duo.train`) and the scorer-only fits (:mod:`kvjax.scorer_fit.fit`). A task gives
its state (a pytree), ``step_fn(state, step) -> (state, metrics)`` (it fetches its own batch
for ``step``: the data order depends on the step only, so a resumed run sees the same
batches) and what a resume must share (``meta``).

- One checkpoint format: :class:`kvjax.train.checkpoint.Checkpointer` (orbax; the state and a
  JSON ``meta`` saved together, the last ``keep`` kept).
- One resume rule (:func:`resume`): the newest checkpoint whose ``meta`` equals this run's
  restores; one of another run is refused with the key that differs; a damaged one is moved
  aside and the one before it tried.
- One progress format: a ``tqdm`` bar with the logged metrics as its postfix, and
  ``metrics.jsonl`` (:class:`kvjax.train.metrics_log.MetricsLog`) every ``log_every`` steps.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from kvjax.train.checkpoint import Checkpointer
from kvjax.train.metrics_log import MetricsLog


class Preempted:
    """Turns SIGTERM/SIGINT into a flag the loop checks after each step."""

    def __init__(self):
        self.flag = False
        self.signal: str | None = None
        self.old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.old[sig] = signal.signal(sig, self._set)
        return self

    def _set(self, signum, frame):
        self.flag = True
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, h in self.old.items():
            signal.signal(sig, h)


def resume(ckpt: Checkpointer, state, meta: dict, *, say=None) -> tuple[Any, int]:
    """``(state, start step)``: the newest checkpoint of this run (``meta`` equal), else ``state``
    and 0. ``state`` gives the structure, shapes, dtypes and shardings to restore into."""
    say = say or (lambda m: print(m, file=sys.stderr))
    if ckpt.latest_step() is None:
        return state, 0
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                            state)
    good = ckpt.restore_latest_good(abstract, meta, say=say)
    if good is None:
        say(f"warning: no readable checkpoint left under {ckpt.dir}; starting from step 0")
        return state, 0
    restored, _, start = good
    return restored, start


@dataclasses.dataclass
class StepLoop:
    """How one run steps: ``total`` steps, a checkpoint every ``checkpoint_every`` (and at the end
    and on a stop), metrics every ``log_every``."""

    total: int
    ckpt: Checkpointer
    meta: dict
    desc: str
    checkpoint_every: int = 0
    log: MetricsLog | None = None
    log_every: int = 1
    progress: bool = True
    lead: bool = True                          # the process that shows the bar and writes the log
    stop_after: int | None = None              # leave after this many steps of this call (tests)
    postfix: tuple[str, ...] = ("loss",)       # the metrics shown on the bar
    meta_at: Callable[[int], dict] | None = None   # more checkpoint metadata for step s (e.g. the data position)
    on_log: Callable[[int, dict], dict] | None = None   # (step, float metrics) -> metrics to log (adds fields)
    after_step: Callable[[int, Any, Any], None] | None = None   # (step, state, bar): e.g. an evaluation

    def run(self, state, step_fn: Callable[[Any, int], tuple[Any, dict]], start: int) -> tuple[Any, dict]:
        """Steps ``start .. total - 1``; returns ``(state, summary)``: ``summary["last_metrics"]``
        (the last logged), ``stopped_at`` and ``signal`` when it left early."""
        bar = tqdm(total=self.total, initial=start, disable=not (self.lead and self.progress), desc=self.desc,
                   dynamic_ncols=True)
        summary: dict = {}
        done_here = 0
        with Preempted() as pre:
            for step in range(start, self.total):
                state, metrics = step_fn(state, step)
                done_here += 1
                bar.update(1)
                last = step + 1 == self.total
                if (step + 1) % self.log_every == 0 or last:
                    m = {k: float(np.asarray(getattr(v, "addressable_data", lambda i: v)(0))) for k, v in metrics.items()}
                    if self.on_log is not None:
                        m = self.on_log(step, m)
                    bar.set_postfix({k: f"{m[k]:.4g}" for k in self.postfix if k in m})
                    if self.log is not None:
                        self.log.write(step + 1, m)
                    summary["last_metrics"] = m
                if self.after_step is not None:
                    self.after_step(step, state, bar)
                stop = pre.flag or (self.stop_after is not None and done_here >= self.stop_after)
                if (self.checkpoint_every and (step + 1) % self.checkpoint_every == 0) or last or stop:
                    extra = self.meta_at(step) if self.meta_at is not None else {}
                    self.ckpt.save(step + 1, state, {**self.meta, "step": step + 1, **extra})
                if stop and not last:
                    self.ckpt.wait()
                    bar.close()
                    if self.lead and self.progress:
                        print(f"stopped at step {step + 1}; checkpoint saved under {self.ckpt.dir}")
                    summary.update(stopped_at=step + 1, signal=pre.signal)
                    return state, summary
        bar.close()
        self.ckpt.wait()
        return state, summary


def train_task(work_dir, state, step_fn, meta: dict, *, steps: int, desc: str, checkpoint_every: int,
               progress: bool = True, postfix: tuple[str, ...] = ("loss",), say=None) -> tuple[Any, dict, int]:
    """A small one-device task on the loop, start to end: checkpoints (synchronous, the last 2)
    under ``work_dir/checkpoints`` and ``work_dir/metrics.jsonl``, resumed from there; a signal
    saves a checkpoint and raises ``KeyboardInterrupt`` (nothing after it runs on half-trained
    state). Returns ``(state, summary, start step)``."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(work / "checkpoints", keep=2, async_save=False)
    meta = plain(meta)
    try:
        state, start = resume(ckpt, state, meta, say=say)
        if start and say is not None:
            say(f"resuming {desc} at step {start} from {ckpt.dir}")
        loop = StepLoop(steps, ckpt, meta, desc, checkpoint_every=checkpoint_every,
                        log=MetricsLog(work, tensorboard=False), progress=progress, postfix=postfix)
        state, summary = loop.run(state, step_fn, start)
    finally:
        ckpt.close()
    if "stopped_at" in summary:
        raise KeyboardInterrupt(f"stopped at step {summary['stopped_at']} ({summary['signal']}); rerun to resume")
    return state, summary, start


def plain(meta: dict) -> dict:
    """``meta`` as it reads back from a checkpoint (JSON: tuples become lists), so that a resume
    compares like with like."""
    return json.loads(json.dumps(meta, default=str))


def logged_history(out_dir, keys: tuple[str, ...]) -> list[list[float]]:
    """The rows ``[metrics[k] for k in keys]`` of ``out_dir/metrics.jsonl`` in step order, the last
    record of each step (a resumed run logs again the steps after its checkpoint)."""
    path = Path(out_dir) / "metrics.jsonl"
    by_step = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                by_step[r["step"]] = [r[k] for k in keys]
    return [by_step[s] for s in sorted(by_step)]
