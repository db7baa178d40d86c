"""``train.py --dry-run``: the train state's shapes under the recipe's mesh and the
per-device memory they imply, computed from shapes alone (no devices, no weights)."""

from __future__ import annotations

import types

import jax
import numpy as np
from flax import nnx

from kvjax.sharding import logical_to_spec
from kvjax.train.config import TrainConfig
from kvjax.train.optim import make_optimizer


def _per_device_bytes(shape, dtype, spec, mesh_shape) -> float:
    div = 1
    for entry in spec:
        for ax in (entry if isinstance(entry, tuple) else (entry,)):
            if ax is not None:
                div *= mesh_shape[ax]
    return float(np.prod(shape)) * np.dtype(dtype).itemsize / div


def _state_bytes(graphdef, params, fake_mesh):
    """``(count, per-device bytes, {shape: fraction of elements per device}, first rows)``."""
    model = nnx.merge(graphdef, params)
    _, state = nnx.split(model)
    count, dev, by_shape, rows = 0, 0.0, {}, []
    for path, var in nnx.to_flat_state(state):
        v = var.get_value()
        axes = getattr(var, "logical_axes", None) or (None,) * len(v.shape)
        spec = logical_to_spec(axes, v.shape, fake_mesh)
        count += int(np.prod(v.shape))
        dev += _per_device_bytes(v.shape, v.dtype, spec, fake_mesh.shape)
        by_shape.setdefault(tuple(v.shape), _per_device_bytes(v.shape, np.int8, spec, fake_mesh.shape)
                            / max(int(np.prod(v.shape)), 1))      # fraction of the elements per device
        if len(rows) < 12:
            rows.append(f"  {'.'.join(map(str, path)):<40} {str(tuple(v.shape)):<22} {str(spec)}")
    return count, dev, by_shape, rows


def dry_run(cfg: TrainConfig) -> str:
    from kvjax.train.tasks import make_task

    mesh_shape = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    fake_mesh = types.SimpleNamespace(shape=mesh_shape)
    task = make_task(cfg, abstract=True)
    total_params, dev_params, by_shape, rows = _state_bytes(task.graphdef, task.params, fake_mesh)
    optimizer, _ = make_optimizer(cfg.optim, task.params, cfg.total_steps)
    opt_shapes = jax.eval_shape(optimizer.init, task.params)
    # Adam moments shard like their parameters; scalars are replicated
    dev_opt = sum(by_shape.get(tuple(x.shape), 1.0) * float(np.prod(x.shape)) * x.dtype.itemsize
                  for x in jax.tree.leaves(opt_shapes))
    frozen_count, dev_frozen = 0, 0.0
    if task.frozen is not None:
        frozen_count, dev_frozen, _, _ = _state_bytes(task.frozen_def, task.frozen, fake_mesh)
    n_dev = int(np.prod(list(mesh_shape.values())))
    batch_rows = cfg.data.batch_size // max(cfg.mesh.data * cfg.mesh.fsdp, 1)
    gib = 2.0 ** 30
    lines = [
        f"dry run: mode={cfg.mode}, mesh data={cfg.mesh.data} fsdp={cfg.mesh.fsdp} tensor={cfg.mesh.tensor} "
        f"({n_dev} devices)",
        f"parameters: {total_params / 1e9:.3f} B trained ({cfg.model.param_dtype})"
        + (f" + {frozen_count / 1e9:.3f} B frozen teacher" if frozen_count else ""),
        *([f"teacher: its top-{cfg.data.teacher_topk} log-probabilities read from {cfg.data.teacher_cache} "
           f"(data.teacher_cache; no teacher in memory)"] if cfg.data.teacher_cache else []),
        "first parameters (shape, partition spec):", *rows,
        f"per device: parameters {dev_params / gib:.2f} GiB + optimizer state {dev_opt / gib:.2f} GiB"
        + (f" + teacher {dev_frozen / gib:.2f} GiB" if frozen_count else "")
        + f" = {(dev_params + dev_opt + dev_frozen) / gib:.2f} GiB (activations excluded)",
        f"batch: {cfg.data.batch_size} sequences x {cfg.data.seq_len} tokens, {batch_rows} rows per data shard, "
        f"grad_accum {cfg.optim.grad_accum}",
    ]
    return "\n".join(lines)
