"""Resumable progress of a small one-device optimisation (DuoAttention's gates, DMS's decisions):
its arrays, optimiser state, step and loss history in one ``.npz``, replaced atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def save_progress(path, arrays: dict, opt_state, step: int, history: list) -> None:
    """Write ``arrays`` (name -> array), the optimiser state's leaves, ``step`` and ``history``
    (rows of floats) to ``path`` through a temporary file (a kill never leaves half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".progress-", suffix=".npz", dir=path.parent)
    os.close(fd)
    leaves = [np.asarray(x) for x in jax.tree.leaves(opt_state)]
    hist = np.asarray(history, np.float64)
    np.savez(tmp, step=step, history=hist.reshape(len(history), -1) if len(history) else hist,
             **{k: np.asarray(v) for k, v in arrays.items()}, **{f"opt_{i}": x for i, x in enumerate(leaves)})
    os.replace(tmp, path)


def load_progress(path, arrays: dict, opt_state):
    """``(arrays, opt_state, step, history)`` from ``path``, shaped like the given ``arrays`` and
    ``opt_state`` (a file of other shapes, e.g. another model's, is refused)."""
    path = Path(path)
    with np.load(path) as z:
        for k, v in arrays.items():
            if k not in z or z[k].shape != tuple(v.shape):
                have = z[k].shape if k in z else "none"
                raise ValueError(f"{path}: {k!r} has shape {have}, this run needs {tuple(v.shape)} "
                                 "(another model's run? use another work_dir)")
        leaves, tree = jax.tree.flatten(opt_state)
        opt_state = jax.tree.unflatten(tree, [jnp.asarray(z[f"opt_{i}"]) for i in range(len(leaves))])
        return ({k: jnp.asarray(z[k]) for k in arrays}, opt_state, int(z["step"]), z["history"].tolist())
