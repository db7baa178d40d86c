"""One ``distill_kvpop`` train step on SmolLM2, the live teacher against the cached teacher top-k, side by side.

    python bench/distill_step.py [--reps 3] [--config configs/smollm2-distill-kvpop.yaml]

Both steps are the trainer's own jitted step (``make_train_step`` over the task's loss) on the
same batch of the config's data, with the same parameters; the cached one reads the teacher's
top-k from ``data.teacher_cache`` (computed first if missing) and runs no teacher. Prints the
median seconds of ``--reps`` steps after one compile step each, and the machine's load.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def time_step(cfg, batch_np: dict, reps: int) -> tuple[float, float]:
    from kvjax.train.optim import make_optimizer
    from kvjax.train.steps import make_train_step
    from kvjax.train.tasks import make_task

    task = make_task(cfg)
    optimizer, _ = make_optimizer(cfg.optim, task.params, cfg.total_steps, [cfg.total_steps])
    step = jax.jit(make_train_step(task.loss_fn, optimizer, 1))
    batch = {k: jnp.asarray(batch_np[k]) for k in task.batch_keys}
    ones = jax.tree.map(lambda _: jnp.float32(1), task.params)
    args = (task.params, task.frozen, optimizer.init(task.params), batch, jax.random.key(0), ones,
            jnp.float32(1), jnp.int32(0))
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def main(argv=None) -> None:
    from kvjax.configio import load_config
    from kvjax.train.config import TrainConfig
    from kvjax.train.data import JsonlTokenSource
    from kvjax.train.teacher_cache import ensure_teacher_cache, load_teacher_cache

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-distill-kvpop.yaml")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    cached = load_config(TrainConfig, args.config)
    if cached.data.teacher_cache is None:
        raise SystemExit(f"{args.config} sets no data.teacher_cache")
    live = cached.replace(data=dataclasses.replace(cached.data, teacher_cache=None))
    ensure_teacher_cache(cached)
    source = JsonlTokenSource(cached.data.path, cached.data.seq_len)
    teacher = load_teacher_cache(cached, len(source))
    rows = [JsonlTokenSource(cached.data.path, cached.data.seq_len, teacher)[i] for i in range(cached.data.batch_size)]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    tokens = cached.data.batch_size * cached.data.seq_len
    print(f"load before: {os.getloadavg()[0]:.2f}; batch {cached.data.batch_size} x {cached.data.seq_len}")
    out = {}
    for name, cfg in (("live teacher", live), ("cached top-k", cached)):
        first, med = time_step(cfg, batch, args.reps)
        out[name] = med
        print(f"{name:>13}: first step {first:.1f} s, median of {args.reps} {med:.2f} s ({tokens / med:.0f} tokens/s)")
    print(f"speed-up {out['live teacher'] / out['cached top-k']:.2f}x; load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
