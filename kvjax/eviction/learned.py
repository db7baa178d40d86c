"""KVpop's learned policies: static priorities ``p_t = r_t + lambda_h t`` from trained
scorers, over the same bounded cache and keep rule as every other policy.

- ``kvpop_mlp``: ``r_t`` from a per-head MLP on ``[k_t; v_t]`` (scored when it exits).
- ``kvpop_mlstm``: ``r_t`` read out at ``q = t + w`` from an mLSTM memory that has absorbed
  tokens ``0..q``; the memory is part of the cache (``BoundedCache.policy_state``), updated every
  step, so decode scores equal the training-time (chunkwise) scores.

The scorer's graph definition is static (part of the policy's hash); its weights travel
as ``params``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flax import nnx

from kvjax.eviction.bounded import StaticPriority
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.registry import register
from kvjax.eviction.keep_rule import static_priority


@dataclasses.dataclass(frozen=True)
class _Learned(StaticPriority):
    scorer_def: Any = None
    # the scorer learned each head's level of its target (a fit not centred, e.g. on KVzip's
    # reconstruction score): its priorities compare across heads, and a shared budget reads them as
    # they are. A centred fit (the default) learns each head's ranking only, up to an offset of its
    # own, so a shared budget z-scores them first (EvictionConfig.head_norm "auto")
    levels: bool = False

    @property
    def comparable_priorities(self) -> bool:
        return self.levels

    def scorer(self, params):
        if params is None or self.scorer_def is None:
            raise ValueError(f"the {self.name} policy needs trained scorer weights: build it with "
                             f"kvjax.eviction.learned.from_scorer(scorer, config) or kvjax.load_scorers(dir)")
        return nnx.merge(self.scorer_def, params)

    # ---- export (kvjax.export): each learned policy writes and reads its own scorer ------------
    def export_scorer(self):
        """The module whose weights ``export_scorers`` writes."""
        return self.scorer(self.params)

    def export_budgets(self):
        """Per-head budgets ``[L, K]`` to record, or ``None``."""
        return None

    def export_sizes(self) -> dict:
        """The scorer's sizes for ``scorer_config.json`` (each learned policy gives its own)."""
        raise NotImplementedError(f"policy {self.name!r} defines no export_sizes()")

    @classmethod
    def from_export(cls, scorer, config: EvictionConfig, meta: dict, budgets, fits):
        """The policy of an exported ``scorer`` (loaded weights) and its ``scorer_config.json``."""
        graphdef, state = nnx.split(scorer)
        return cls(config, params=nnx.to_pure_dict(state), scorer_def=graphdef, fits=fits, **cls.export_kwargs(meta))

    @classmethod
    def export_kwargs(cls, meta: dict) -> dict:
        return {"levels": bool(meta.get("levels", False))}      # exports before the field: centred fits


@register
@dataclasses.dataclass(frozen=True)
class KVpopMLP(_Learned):
    name: ClassVar[str] = "kvpop_mlp"
    export_kind: ClassVar[str] = "mlp"

    @staticmethod
    def make_scorer(meta: dict):
        from kvjax.scorers.build import make_scorer

        return make_scorer("mlp", meta["num_layers"], meta["kv_heads"], meta["head_dim"], hidden=meta["hidden"],
                           activation=meta["activation"])

    def export_sizes(self) -> dict:
        sc = self.export_scorer()
        return {"hidden": int(sc.w1[...].shape[-1]), "activation": sc.activation}

    def scores_and_priority(self, params, layer, k_BSKD, v_BSKD, positions_BS, lengths_B=None):
        """``(r_hat, p_hat, None)``, ``[B, K, S]`` each: the scorer's scores and static priorities
        (the MLP keeps no state)."""
        sc = self.scorer(params)
        r = sc.scores(layer, k_BSKD, v_BSKD)
        return r, static_priority(r, sc.decay(layer), positions_BS[:, None, :]), None

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        return self.scores_and_priority(params, layer, k_BSKD, v_BSKD, t_BS)[1]


@register
@dataclasses.dataclass(frozen=True)
class KVpopMLSTM(_Learned):
    name: ClassVar[str] = "kvpop_mlstm"
    export_kind: ClassVar[str] = "mlstm"
    chunk: int = 64

    @staticmethod
    def make_scorer(meta: dict):
        from kvjax.scorers.build import make_scorer

        # exports written before readout_norm existed read the memory without the norm
        return make_scorer("mlstm", meta["num_layers"], meta["kv_heads"], meta["head_dim"], qk_dim=meta["qk_dim"],
                           v_dim=meta["v_dim"], readout_norm=meta.get("readout_norm", False))

    def export_sizes(self) -> dict:
        sc = self.export_scorer()
        return {"qk_dim": int(sc.qk_dim), "v_dim": int(sc.v_dim), "chunk": self.chunk, "readout_norm": sc.readout_norm}

    @classmethod
    def export_kwargs(cls, meta: dict) -> dict:
        return {**super().export_kwargs(meta), "chunk": meta["chunk"]}

    def init_policy_state(self, params, cfg, batch):
        sc = self.scorer(params)
        return tuple(sc.init_state(batch) for _ in range(cfg.num_layers))

    def scores_and_priority(self, params, layer, k_BSKD, v_BSKD, positions_BS, lengths_B=None):
        """``(r_hat, p_hat, memory)`` of a whole sequence (chunkwise form): the delayed scores and
        static priorities ``[B, K, S]``, and the memory after each row's last real token."""
        sc = self.scorer(params)
        r, st = sc.prefill(layer, k_BSKD, v_BSKD, self.effective().window, lengths_B=lengths_B, chunk=self.chunk)
        return r, static_priority(r, sc.decay(layer), positions_BS[:, None, :]), st

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        return self.scores_and_priority(params, layer, k_BSKD, v_BSKD, t_BS)[1]

    def prefill_priority(self, params, layer, k_BSKD, v_BSKD, positions_BS, lengths_B, state):
        _, p, st = self.scores_and_priority(params, layer, k_BSKD, v_BSKD, positions_BS, lengths_B)
        return p, st

    def exit_priority(self, params, layer, k_new_BKD, v_new_BKD, k_exit_BKD, v_exit_BKD, t_B, state):
        sc = self.scorer(params)
        state, r_BK = sc.step(layer, state, k_new_BKD, v_new_BKD, k_exit_BKD, v_exit_BKD)
        return static_priority(r_BK[:, :, None], sc.decay(layer), t_B[:, None, None])[:, :, 0], state


def from_scorer(scorer, config: EvictionConfig, chunk: int | None = None, *, levels: bool = False) -> _Learned:
    """The KVpop policy for a trained ``MLPScorer`` or ``MLSTMScorer`` (the one place that maps a
    scorer's type to its policy); ``chunk``: the mLSTM's chunkwise prefill chunk (the MLP reads
    each token alone and has none); ``levels``: the scorer was fitted without centring
    (:attr:`_Learned.levels`)."""
    from kvjax.scorers import MLPScorer, MLSTMScorer

    graphdef, state = nnx.split(scorer)
    cls = KVpopMLP if isinstance(scorer, MLPScorer) else KVpopMLSTM if isinstance(scorer, MLSTMScorer) else None
    if cls is None:
        raise TypeError(f"from_scorer: expected an MLPScorer or MLSTMScorer, got {type(scorer).__name__}")
    kw = {"chunk": chunk} if chunk is not None and cls is KVpopMLSTM else {}
    return cls(config, params=nnx.to_pure_dict(state), scorer_def=graphdef, levels=levels, **kw)
