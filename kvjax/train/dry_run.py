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


def dry_run(cfg: TrainConfig) -> str:
    from kvjax.train.tasks import make_task

    mesh_shape = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    fake_mesh = types.SimpleNamespace(shape=mesh_shape)
    task = make_task(cfg, abstract=True)
    model = nnx.merge(task.graphdef, task.params)
    _, state = nnx.split(model)
    rows, total_params, dev_params = [], 0, 0.0
    specs = {}
    for path, var in nnx.to_flat_state(state):
        v = var.get_value()
        axes = getattr(var, "logical_axes", None) or (None,) * len(v.shape)
        spec = logical_to_spec(axes, v.shape, fake_mesh)
        specs[path] = spec
        b = _per_device_bytes(v.shape, v.dtype, spec, mesh_shape)
        total_params += int(np.prod(v.shape))
        dev_params += b
        if len(rows) < 12:
            rows.append(f"  {'.'.join(map(str, path)):<40} {str(tuple(v.shape)):<22} {str(spec)}")
    optimizer, _ = make_optimizer(cfg.optim, task.params, cfg.total_steps)
    opt_shapes = jax.eval_shape(optimizer.init, task.params)
    # Adam moments shard like their parameters; scalars are replicated
    param_bytes_by_shape = {}
    for path, var in nnx.to_flat_state(state):
        v = var.get_value()
        param_bytes_by_shape.setdefault(tuple(v.shape), _per_device_bytes(v.shape, np.float32, specs[path],
                                                                           mesh_shape))
    dev_opt = sum(param_bytes_by_shape.get(tuple(x.shape), float(np.prod(x.shape)) * x.dtype.itemsize)
                  for x in jax.tree.leaves(opt_shapes))
    n_dev = int(np.prod(list(mesh_shape.values())))
    batch_rows = cfg.data.batch_size // max(cfg.mesh.data * cfg.mesh.fsdp, 1)
    gib = 2.0 ** 30
    lines = [
        f"dry run: mode={cfg.mode}, mesh data={cfg.mesh.data} fsdp={cfg.mesh.fsdp} tensor={cfg.mesh.tensor} "
        f"({n_dev} devices)",
        f"parameters: {total_params / 1e9:.3f} B ({cfg.model.param_dtype})",
        "first parameters (shape, partition spec):", *rows,
        f"per device: parameters {dev_params / gib:.2f} GiB + optimizer state {dev_opt / gib:.2f} GiB "
        f"= {(dev_params + dev_opt) / gib:.2f} GiB (activations excluded)",
        f"batch: {cfg.data.batch_size} sequences x {cfg.data.seq_len} tokens, {batch_rows} rows per data shard, "
        f"grad_accum {cfg.optim.grad_accum}",
    ]
    return "\n".join(lines)
