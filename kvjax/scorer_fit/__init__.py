"""Scorer-only KVpop on a frozen model: the teacher-feature pass, then per-head scorer fits."""

from kvjax.scorer_fit.features import FeatureConfig, FeatureSplit, build_features
from kvjax.scorer_fit.fit import FitConfig, fit_scorers

__all__ = ["FeatureConfig", "FeatureSplit", "build_features", "FitConfig", "fit_scorers"]
