"""``Task``: what the trainer needs from a training mode (model, trainable parameters, loss)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx


@dataclasses.dataclass
class Task:
    graphdef: Any                                 # the model (or, when distilling, the student)
    params: Any                                   # trainable pytree (plain dicts of arrays)
    loss_fn: Callable                             # (params, frozen, batch, rng, step) -> (loss, aux)
    batch_keys: tuple[str, ...]                   # the batch fields the loss reads
    frozen: Any = None                            # read-only pytree (e.g. the teacher's weights)
    frozen_def: Any = None
    to_model: Callable | None = None              # params -> a Decoder to evaluate / save

    def model(self, params=None):
        params = self.params if params is None else params
        if self.to_model is not None:
            return self.to_model(params)
        return nnx.merge(self.graphdef, params)
