"""Declared sharding: logical axis names on every parameter, one rules table to mesh axes.

Mesh axes: ``data`` (batch only), ``fsdp`` (batch and parameter shards), ``tensor``
(heads / MLP width). A logical axis whose size a mesh axis does not divide is left
replicated rather than padded (e.g. one KV head under ``tensor=2``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "layers": None,
    "scorer_hidden": None,
}


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all devices)."""
    devices = jax.devices() if devices is None else devices
    need = data * fsdp * tensor
    if need != len(devices):
        raise ValueError(
            f"mesh: data*fsdp*tensor = {data}*{fsdp}*{tensor} = {need} does not match "
            f"the {len(devices)} available devices"
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, object] = LOGICAL_RULES) -> P:
    """PartitionSpec for an array with logical ``axes``; non-dividing mesh axes are dropped."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    spec, used = [], set()
    for name, size in zip(axes, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no sharding rule")
        target = rules[name]
        mesh_axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        kept = []
        for ax in mesh_axes:
            n = mesh.shape[ax]
            prod = int(np.prod([mesh.shape[a] for a in kept])) * n
            if ax not in used and size % prod == 0:
                kept.append(ax)
        used.update(kept)
        spec.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return P(*spec)


def named_sharding(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))
