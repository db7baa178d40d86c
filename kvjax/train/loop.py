"""The training loop behind ``train.py``: mesh, sharded state, phases, logging,
evaluation, checkpoints with exact resume, and clean exit on SIGTERM/SIGINT."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from kvjax.configio import to_dict
from kvjax.dir_lock import DirLock
from kvjax.sharding import make_mesh
from kvjax.train.checkpoint import Checkpointer, weights_fingerprint, write_json_atomic
from kvjax.train.config import TrainConfig
from kvjax.train.data import make_dataset, phase_seq_len, testbed_config
from kvjax.train.metrics_log import MetricsLog
from kvjax.train.optim import make_optimizer, param_count, trainable_mask
from kvjax.train.shard_state import param_shardings, place_on_mesh, tree_shardings
from kvjax.train.step_loop import StepLoop, resume
from kvjax.train.steps import make_train_step
from kvjax.train.tasks import make_task


def maybe_initialize_distributed(cfg: TrainConfig) -> None:
    """``jax.distributed.initialize`` when the config or the environment asks for it."""
    env = os.environ.get("KVJAX_MULTI_HOST") == "1" or "JAX_COORDINATOR_ADDRESS" in os.environ
    if not (cfg.mesh.multi_host or env) or jax.distributed.is_initialized():
        return
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU collectives over TCP
    kw = {}
    if cfg.mesh.coordinator:
        kw = dict(coordinator_address=cfg.mesh.coordinator, num_processes=cfg.mesh.num_processes,
                  process_id=cfg.mesh.process_id)
    jax.distributed.initialize(**kw)


def _phase_at(phases, step: int):
    start = 0
    for i, ph in enumerate(phases):
        if step < start + ph.steps:
            return i, ph, step - start
        start += ph.steps
    raise IndexError(step)


def meta_for(cfg: TrainConfig) -> dict:
    """What a checkpoint must share with the run resuming it (with ``model.hf_path``, also the
    weights found there: a retrained teacher at the same path does not resume a stale run)."""
    d = to_dict(cfg)
    meta = {"mode": cfg.mode, "model": d["model"], "phases": d["phases"], "data": d["data"],
            "optim": d["optim"], "eviction": d["eviction"], "seed": cfg.seed,
            "total_steps": cfg.total_steps}   # the learning-rate schedule is laid out over it
    if cfg.model.hf_path:
        meta["model_weights"] = weights_fingerprint(cfg.model.hf_path)
    return meta


def train(cfg: TrainConfig, *, stop_after: int | None = None, quiet: bool = False) -> dict:
    """Run (or resume) the training ``cfg`` describes; returns a summary dict.

    ``stop_after``: leave after this many steps of this call as if preempted (tests).
    """
    maybe_initialize_distributed(cfg)
    out = Path(cfg.out_dir)
    lead = jax.process_index() == 0
    lock = DirLock(out, "training run") if lead else None
    try:
        return _train(cfg, out, lead, stop_after, quiet)
    finally:
        if lock is not None:
            lock.release()


@dataclasses.dataclass
class _Run:
    """What the loop carries: the config, the jitted step and its state, and the run's outputs."""

    cfg: TrainConfig
    out: Path
    lead: bool
    quiet: bool
    task: Any
    params: Any
    frozen: Any
    opt_state: Any
    step_fn: Callable
    scheds: dict
    batch_sharding: NamedSharding
    ckpt: Checkpointer | None = None
    meta: dict | None = None
    log: MetricsLog | None = None
    teacher: Any = None        # the cached teacher top-k of data.path's rows (data.teacher_cache), else None


def _setup(cfg: TrainConfig, out: Path, lead: bool, quiet: bool) -> _Run:
    """The mesh, the task's parameters placed on it, the optimizer and the jitted train step."""
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=_mesh_devices(cfg))
    task = make_task(cfg)
    p_sh = param_shardings(task.graphdef, task.params, mesh)
    params = jax.tree.map(lambda x, s: jax.device_put(x, s), task.params, p_sh)
    frozen = None
    if task.frozen is not None:
        f_sh = param_shardings(task.frozen_def, task.frozen, mesh)
        frozen = jax.tree.map(lambda x, s: jax.device_put(x, s), task.frozen, f_sh)
    optimizer, scheds = make_optimizer(cfg.optim, params, cfg.total_steps, [p.steps for p in cfg.all_phases()])
    opt_state = place_on_mesh(jax.jit(optimizer.init)(params), mesh)
    step_fn = jax.jit(make_train_step(task.loss_fn, optimizer, cfg.optim.grad_accum),
                      out_shardings=(p_sh, tree_shardings(opt_state), None), donate_argnums=(0, 2))
    return _Run(cfg, out, lead, quiet, task, params, frozen, opt_state, step_fn, scheds,
                NamedSharding(mesh, P(("data", "fsdp"))))


def _restore(run: _Run) -> int:
    """Resume from the latest readable checkpoint of the same run (else step 0; the one resume
    rule, :func:`kvjax.train.step_loop.resume`); then write the run's ``config.json`` (only now: a
    refused resume leaves it as it was)."""
    cfg, lead = run.cfg, run.lead
    run.ckpt = Checkpointer(cfg.checkpoint.dir or run.out / "checkpoints", cfg.checkpoint.keep)
    run.meta = meta_for(cfg)
    state, start = resume(run.ckpt, {"params": run.params, "opt_state": run.opt_state}, run.meta,
                          say=lambda m: print(m, file=sys.stderr) if lead else None)
    run.params, run.opt_state = state["params"], state["opt_state"]
    if start and lead and not run.quiet:
        print(f"resumed from {run.ckpt.dir} at step {start}")
    if lead:
        write_json_atomic(run.out / "config.json", to_dict(cfg))
    return start


def _train(cfg: TrainConfig, out: Path, lead: bool, stop_after: int | None, quiet: bool) -> dict:
    run = _setup(cfg, out, lead, quiet)
    start = _restore(run)
    if cfg.data.teacher_cache is not None:
        from kvjax.train.data import JsonlTokenSource
        from kvjax.train.teacher_cache import ensure_teacher_cache, load_teacher_cache

        if lead:
            ensure_teacher_cache(cfg, quiet=quiet)
        run.teacher = load_teacher_cache(cfg, len(JsonlTokenSource(cfg.data.path, cfg.data.seq_len)))
    run.log = MetricsLog(out, tensorboard=cfg.log.tensorboard) if lead else None
    summary = _loop(run, start, stop_after)
    run.ckpt.wait()
    run.ckpt.close()
    if run.log:
        run.log.close()
    if "stopped_at" in summary:
        return summary
    summary.update(steps=cfg.total_steps, resumed_from=start, params_tree=run.params)
    if cfg.save_hf:
        host_params = _to_host(run.params)
        if lead:
            _export_hf(cfg, run.task, host_params)
    return summary


def _loop(run: _Run, start: int, stop_after: int | None) -> dict:
    """Steps ``start .. total - 1`` through the one training loop (:class:`kvjax.train.step_loop.StepLoop`),
    with the log, evaluation and checkpoint hooks after each; returns early (``stopped_at``) on a
    signal or after ``stop_after`` steps of this call."""
    cfg = run.cfg
    phases = cfg.all_phases()
    datasets, masks, where = {}, {}, {}
    key = jax.random.key(cfg.seed)
    clock = {"t": time.perf_counter(), "tokens": 0}

    def step_fn(state, step):
        pi, phase, local = _phase_at(phases, step)
        if pi not in datasets:
            datasets[pi] = make_dataset(cfg.data, phase, cfg.seed + 1000 * pi, run.teacher)
            masks[pi] = trainable_mask(state["params"], phase.trainable)
        batch_np = datasets[pi][local]
        batch = {k: _global(batch_np[k], run.batch_sharding) for k in run.task.batch_keys}
        params, opt_state, metrics = run.step_fn(
            state["params"], run.frozen, state["opt_state"], batch, jax.random.fold_in(key, step), masks[pi],
            jnp.float32(phase.lr_scale), jnp.int32(step))
        clock["tokens"] += int(np.prod(batch_np["tokens"].shape)) * jax.process_count()
        where[step] = (pi, phase, local)
        return {"params": params, "opt_state": opt_state}, metrics

    def on_log(step, m):
        pi, phase, _ = where[step]
        now = time.perf_counter()
        m["tokens_per_s"] = clock["tokens"] / max(now - clock["t"], 1e-9)
        m.update({f"lr_{g}": float(s(step)) * phase.lr_scale for g, s in run.scheds.items()})
        m["phase"] = pi
        clock["t"], clock["tokens"] = now, 0
        return m

    summary: dict = {"params": param_count(run.params)}

    def after_step(step, state, bar):
        last = step + 1 == cfg.total_steps
        if cfg.data.eval_problems and (last or (cfg.log.eval_every and (step + 1) % cfg.log.eval_every == 0)):
            run.params = state["params"]
            _eval_hook(run, step, bar, summary)

    def meta_at(step):
        pi, _, local = where[step]
        return {"data_position": {"phase": pi, "batch": local + 1}}

    loop = StepLoop(cfg.total_steps, run.ckpt, run.meta, cfg.mode, checkpoint_every=cfg.checkpoint.every,
                    log=run.log, log_every=cfg.log.every, progress=not run.quiet, lead=run.lead,
                    stop_after=stop_after, postfix=("loss", "tokens_per_s"), meta_at=meta_at, on_log=on_log,
                    after_step=after_step)
    state, result = loop.run({"params": run.params, "opt_state": run.opt_state}, step_fn, start)
    run.params, run.opt_state = state["params"], state["opt_state"]
    summary.update(result)
    if "stopped_at" in summary:
        summary["params_tree"] = run.params
    return summary


def _eval_hook(run: _Run, step: int, bar, summary: dict) -> None:
    """Held-out metrics on the lead process (the parameter gather is collective)."""
    host_params = _to_host(run.params)
    ev = evaluate(run.cfg, run.task, host_params) if run.lead else {}
    if ev:
        run.log.write_eval(step + 1, ev)
        summary["eval"] = ev
        bar.write(f"step {step + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()))


def _to_host(params):
    """Parameters as host numpy arrays (gathered across processes; collective)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(params, tiled=True)
    return jax.device_get(params)


def _mesh_devices(cfg: TrainConfig):
    """The first ``data * fsdp * tensor`` devices (all of them on a multi-host run)."""
    n = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor
    devs = jax.devices()
    if jax.process_count() > 1 or n > len(devs):
        return devs
    return devs[:n]


def _global(x: np.ndarray, sharding: NamedSharding):
    """This process's rows -> a global batch array (batch axis over data x fsdp)."""
    spec = sharding.spec if x.ndim >= 1 else P()
    sh = NamedSharding(sharding.mesh, P(*spec[:1], *([None] * (x.ndim - 1)))) if x.ndim else sharding
    if jax.process_count() == 1:
        return jax.device_put(x, sh)
    return jax.make_array_from_process_local_data(sh, x)


def evaluate(cfg: TrainConfig, task, params) -> dict:
    """Held-out testbed metrics on the final phase's task (pretrain mode)."""
    if cfg.data.source != "testbed" or cfg.mode != "pretrain":
        return {}
    from kvjax.evaluation.quality import dense_quality

    phase = cfg.all_phases()[-1]
    tb, seq_len = testbed_config(cfg.data, phase), phase_seq_len(cfg.data, phase)
    return dense_quality(task.model(params), tb, cfg.data.eval_problems, seq_len, 32, "valid",
                         answer_num=max(cfg.data.eval_problems // 4, 1))


def _export_hf(cfg: TrainConfig, task, params) -> None:
    from kvjax.convert.hf_io import save_hf

    model = task.model(params)
    path = save_hf(model, cfg.save_hf)
    if cfg.data.source == "testbed":
        from kvjax.data import save_tokenizer

        save_tokenizer(path)
