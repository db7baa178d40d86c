"""DMS's decision heads, trained by distillation (:mod:`kvjax.dms.train`)."""

from kvjax.dms.train import DMSConfig, export_decisions, soft_eviction_backend, train_decisions

__all__ = ["DMSConfig", "export_decisions", "soft_eviction_backend", "train_decisions"]
