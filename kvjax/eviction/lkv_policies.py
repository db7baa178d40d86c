"""LKV's inference policies, over the same bounded cache and keep rule as every other policy.

- ``lkv``: LKV-H's per-head budgets ``b_lh = floor(r_lh k_max)`` and LKV-T's token scores
  ``u_t`` as static priorities (hard top-``b_lh`` of ``u``).
- ``lkv_kvpop_mlstm``: LKV-H's budgets with KVpop's delayed mLSTM scorer choosing the
  tokens -- a combination neither seed reports.

The budgets are fixed integers (LKV-H depends only on its head embeddings), computed once
when the policy is built; the cache is padded to ``k_max`` slots per head and each head
fills ``b_lh`` of them. The ratios' keep ratio is ``R = topk / k_max``, so the budgets sum
to at most ``L K topk``: the same number of long-range tokens as a uniform policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.eviction.bounded import StaticPriority
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.learned import KVpopMLSTM
from kvjax.eviction.registry import register


def lkv_keep_ratio(config: EvictionConfig) -> float:
    """``R = topk / k_max``: the fraction of the padded long-range slots LKV-H may fill."""
    if config.k_max is None or not 0 < config.topk < config.k_max:
        raise ValueError(f"LKV policies need 0 < topk < k_max (k_max: the slots a head may fill at most), "
                         f"got topk={config.topk}, k_max={config.k_max}")
    return config.topk / config.k_max


def head_budgets_from(heads, config: EvictionConfig):
    """Integer budgets ``int32 [L, K]`` of a trained ``LKVHeads`` under ``config``."""
    return heads.budgets(lkv_keep_ratio(config), config.k_max, config.k_max)


@dataclasses.dataclass(frozen=True)
class _LearnedBudgets:
    """Per-head budgets from ``params["budgets"]`` (``int [L, K]``), learned at ``budgets_at =
    (topk, k_max)``. A policy built with another ``config.topk`` (``at_budget``,
    ``dataclasses.replace(policy, config=...)``, ``make_policy(name, config, params=...)``) keeps
    the learned split, rescaled: ``b'_lh = min(floor(b_lh topk' / topk), k_max')`` with
    ``k_max' = max(ceil(k_max topk' / topk), topk' + 1)`` unless the new config sets its own cap
    (the keep ratio ``R = topk / k_max`` is unchanged, so the total stays <= ``L K topk'``).
    Budgets given without ``budgets_at`` were learned at ``topk = ceil(mean b)`` (LKV-H's integer
    budgets lose less than one slot per head)."""

    budgets_at: tuple[int, int] | None = None

    def __post_init__(self):
        super().__post_init__()
        budgets = self.params.get("budgets") if isinstance(self.params, dict) else None
        if budgets is None:
            return
        try:
            b = np.asarray(budgets)
        except jax.errors.TracerArrayConversionError:      # rebuilt inside a trace: already normalised
            return
        at = self.budgets_at
        if at is None:
            topk0 = int(math.ceil(float(b.mean()) - 1e-9)) if b.size else 0
            at = (topk0, int(max(b.max(initial=0), topk0 + 1)))
        topk0, k_max0 = int(at[0]), int(at[1])
        ev = self.config
        if ev.topk == topk0 or self.compression is not None:       # a pending ratio rescales when resolved
            object.__setattr__(self, "budgets_at", (topk0, k_max0))
            return
        if topk0 <= 0:
            raise ValueError(f"policy {self.name!r}: its per-head budgets are all 0; they cannot be rescaled "
                             f"to topk={ev.topk}")
        scale = ev.topk / topk0
        k_max = max(int(math.ceil(k_max0 * scale)), ev.topk + 1)
        if ev.k_max is not None and ev.k_max != k_max0:
            if ev.k_max <= ev.topk:
                raise ValueError(f"policy {self.name!r}: k_max={ev.k_max} must exceed topk={ev.topk} (learned "
                                 "per-head budgets need room above the mean); leave k_max unset to size it")
            k_max = ev.k_max                                # the caller's own cap
        scaled = np.minimum(np.floor(b * scale).astype(np.int32), k_max)
        object.__setattr__(self, "config", dataclasses.replace(ev, k_max=k_max))
        object.__setattr__(self, "params", {**self.params, "budgets": jnp.asarray(scaled, jnp.int32)})
        object.__setattr__(self, "budgets_at", (ev.topk, k_max))

    def export_budgets(self):
        return _field(self.params, "budgets", self.name)

    def head_budgets(self, params, cfg, batch: int):
        if self.effective().budgets != "uniform":
            raise ValueError(f"policy {self.name!r}: LKV-H sets its own per-head budgets; "
                             f"budgets={self.effective().budgets!r} would replace them (use budgets='uniform')")
        budgets = _field(params, "budgets", self.name)
        if budgets.shape != (cfg.num_layers, cfg.num_kv_heads):
            raise ValueError(f"policy {self.name!r}: budgets have shape {budgets.shape}, the model needs "
                             f"[layers, kv_heads] = {(cfg.num_layers, cfg.num_kv_heads)}")
        budgets = jnp.minimum(jnp.asarray(budgets, jnp.int32), self.effective().slots)
        return jnp.broadcast_to(budgets[:, None, :], (cfg.num_layers, batch, cfg.num_kv_heads))


def _missing_weights(name: str) -> ValueError:
    return ValueError(f"the {name} policy needs trained LKV weights: build it with "
                      f"kvjax.eviction.lkv_policies.{'lkv_policy' if name == 'lkv' else 'lkv_budgets_policy'}"
                      f"(...) or kvjax.load_scorers(dir)")


def _field(params, key: str, name: str):
    if not isinstance(params, dict) or key not in params:
        raise _missing_weights(name)
    return params[key]


@register
@dataclasses.dataclass(frozen=True)
class LKV(_LearnedBudgets, StaticPriority):
    """``params = {"budgets": int [L, K], "tokens": LKVTokenScorer weights}``."""

    name: ClassVar[str] = "lkv"
    export_kind: ClassVar[str] = "lkv"
    tokens_def: Any = None

    @staticmethod
    def make_scorer(meta: dict):
        from kvjax.lkv import LKVTokenScorer

        return LKVTokenScorer(meta["num_layers"], meta["kv_heads"], meta["head_dim"], meta["hidden"], rngs=nnx.Rngs(0))

    def export_scorer(self):
        if self.tokens_def is None:
            raise _missing_weights(self.name)
        return nnx.merge(self.tokens_def, _field(self.params, "tokens", self.name))

    def export_sizes(self) -> dict:
        return {"hidden": int(self.export_scorer().w1[...].shape[-1])}

    @classmethod
    def from_export(cls, scorer, config: EvictionConfig, meta: dict, budgets, fits):
        tokens_def, tokens = nnx.split(scorer)
        return cls(config, params={"budgets": budgets, "tokens": nnx.to_pure_dict(tokens)}, tokens_def=tokens_def,
                   fits=fits, budgets_at=_learned_at(config))

    def priority(self, params, layer, k_BSKD, v_BSKD, t_BS):
        if self.tokens_def is None:
            raise _missing_weights(self.name)
        return nnx.merge(self.tokens_def, _field(params, "tokens", self.name)).scores(layer, k_BSKD, v_BSKD)


@register
@dataclasses.dataclass(frozen=True)
class LKVBudgetsKVpopMLSTM(_LearnedBudgets, KVpopMLSTM):
    """``params = {"budgets": int [L, K], "scorer": MLSTMScorer weights}``."""

    name: ClassVar[str] = "lkv_kvpop_mlstm"

    def scorer(self, params):
        return super().scorer(_field(params, "scorer", self.name))

    @classmethod
    def from_export(cls, scorer, config: EvictionConfig, meta: dict, budgets, fits):
        scorer_def, state = nnx.split(scorer)
        return cls(config, params={"budgets": budgets, "scorer": nnx.to_pure_dict(state)}, scorer_def=scorer_def,
                   fits=fits, budgets_at=_learned_at(config), **cls.export_kwargs(meta))


def lkv_policy(heads, token_scorer, config: EvictionConfig) -> LKV:
    """The ``lkv`` policy of trained ``LKVHeads`` and ``LKVTokenScorer``."""
    tokens_def, tokens = nnx.split(token_scorer)
    return LKV(config, params={"budgets": head_budgets_from(heads, config), "tokens": nnx.to_pure_dict(tokens)},
               tokens_def=tokens_def, budgets_at=_learned_at(config))


def lkv_budgets_policy(heads, mlstm_scorer, config: EvictionConfig, **kw) -> LKVBudgetsKVpopMLSTM:
    """``lkv_kvpop_mlstm``: trained ``LKVHeads`` budgets, a trained KVpop ``MLSTMScorer``'s tokens."""
    from kvjax.scorers import MLSTMScorer

    if not isinstance(mlstm_scorer, MLSTMScorer):
        raise TypeError(f"lkv_budgets_policy: expected an MLSTMScorer, got {type(mlstm_scorer).__name__}")
    scorer_def, scorer = nnx.split(mlstm_scorer)
    return LKVBudgetsKVpopMLSTM(config, params={"budgets": head_budgets_from(heads, config),
                                                "scorer": nnx.to_pure_dict(scorer)},
                                scorer_def=scorer_def, budgets_at=_learned_at(config), **kw)


def _learned_at(config: EvictionConfig) -> tuple[int, int]:
    """``(topk, k_max)`` the per-head budgets were computed at."""
    return (config.topk, config.slots)
