"""KVpop's learned policies: static priorities ``p_t = r_t + lambda_h t`` from trained
scorers, over the same bounded cache and keep rule as every other policy.

- ``kvpop_mlp``: ``r_t`` from a per-head MLP on ``[k_t; v_t]`` (scored when it exits).
- ``kvpop_mlstm``: ``r_t`` read out at ``q = t + w`` from an mLSTM memory that has absorbed
  tokens ``0..q``; the memory is part of the cache (``BoundedCache.aux``), updated every
  step, so decode scores equal the training-time (chunkwise) scores.

The scorer's graph definition is static (part of the policy's hash); its weights travel
as ``params``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flax import nnx

from kvjax.eviction.bounded import BoundedPolicy
from kvjax.eviction.config import EvictionConfig
from kvjax.scorers.params import static_priority


@dataclasses.dataclass(frozen=True)
class _Learned(BoundedPolicy):
    scorer_def: Any = None

    def scorer(self, params):
        if params is None or self.scorer_def is None:
            raise ValueError(f"the {self.name} policy needs trained scorer weights: build it with "
                             f"kvjax.eviction.learned.from_scorer(scorer, config) or kvjax.load_scorers(dir)")
        return nnx.merge(self.scorer_def, params)


@dataclasses.dataclass(frozen=True)
class KVpopMLP(_Learned):
    name: ClassVar[str] = "kvpop_mlp"

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        return self.scorer(params).priority(layer, k_BSKD, v_BSKD, t_BS)


@dataclasses.dataclass(frozen=True)
class KVpopMLSTM(_Learned):
    name: ClassVar[str] = "kvpop_mlstm"
    chunk: int = 64

    def init_aux(self, params, cfg, batch):
        sc = self.scorer(params)
        return tuple(sc.init_state(batch) for _ in range(cfg.num_layers))

    def training_priority(self, params, layer, k_BSKD, v_BSKD, positions_BS, lengths_B=None):
        """Priorities of a whole sequence (chunkwise form) and the memory after it."""
        sc = self.scorer(params)
        r, st = sc.prefill(layer, k_BSKD, v_BSKD, self.effective().window, lengths_B=lengths_B, chunk=self.chunk)
        return static_priority(r, sc.decay(layer), positions_BS), st

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        return self.training_priority(params, layer, k_BSKD, v_BSKD, t_BS)[0]

    def prefill_priority(self, params, layer, k_BSKD, v_BSKD, positions_BS, lengths_B, aux):
        return self.training_priority(params, layer, k_BSKD, v_BSKD, positions_BS, lengths_B)

    def exit_priority(self, params, layer, k_new_BKD, v_new_BKD, k_exit_BKD, v_exit_BKD, t_B, aux):
        sc = self.scorer(params)
        aux, r_BK = sc.step(layer, aux, k_new_BKD, v_new_BKD, k_exit_BKD, v_exit_BKD)
        return static_priority(r_BK[:, :, None], sc.decay(layer), t_B[:, None])[:, :, 0], aux


def from_scorer(scorer, config: EvictionConfig, **kw) -> _Learned:
    """The KVpop policy for a trained ``MLPScorer`` or ``MLSTMScorer``."""
    from kvjax.scorers import MLPScorer, MLSTMScorer

    graphdef, state = nnx.split(scorer)
    cls = KVpopMLP if isinstance(scorer, MLPScorer) else KVpopMLSTM if isinstance(scorer, MLSTMScorer) else None
    if cls is None:
        raise TypeError(f"from_scorer: expected an MLPScorer or MLSTMScorer, got {type(scorer).__name__}")
    return cls(config, params=nnx.to_pure_dict(state), scorer_def=graphdef, **kw)
