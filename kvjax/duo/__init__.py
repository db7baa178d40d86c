"""DuoAttention's gate optimisation (:mod:`kvjax.duo.train`) and its passkey data."""

from kvjax.duo.train import DuoConfig, export_gates, mixed_attention_backend, train_gates

__all__ = ["DuoConfig", "export_gates", "mixed_attention_backend", "train_gates"]
