"""Shardings of train-state pytrees from the parameters' logical axes."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.sharding import named_sharding


def param_shardings(graphdef, params, mesh: Mesh):
    """A pytree like ``params`` of ``NamedSharding``s (from each Param's ``logical_axes``)."""
    state = nnx.merge(graphdef, params)
    _, vars_state = nnx.split(state)
    flat = {}
    for path, var in nnx.to_flat_state(vars_state):
        axes = getattr(var, "logical_axes", None) or (None,) * var.get_value().ndim
        flat[path] = named_sharding(axes, var.get_value().shape, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda p, _: flat[tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p)], params)


def place_on_mesh(tree, mesh: Mesh):
    """Give every leaf a ``NamedSharding`` on ``mesh`` (leaves without one are replicated),
    so a jitted step sees the same input types on every call."""
    rep = NamedSharding(mesh, P())

    def one(x):
        return x if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh else jax.device_put(x, rep)

    return jax.tree.map(one, tree)


def tree_shardings(tree):
    """The current shardings of a pytree of arrays."""
    return jax.tree.map(lambda x: x.sharding, tree)
