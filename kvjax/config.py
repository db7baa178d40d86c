"""Model configuration: one frozen dataclass for Qwen3 and Llama 3.x, HF config in/out, presets.

The two families share one decoder; they differ only by flags:

| flag          | Qwen3 | Llama 3.x |
|---------------|-------|-----------|
| ``qk_norm``   | True  | False     |
| ``rope_scaling`` | None  | ``llama3`` (3.1+) or None |
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 ``rope_type: llama3`` frequency rescaling (its four parameters)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer (Qwen3 or Llama 3.x)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type: unsupported architecture {self.model_type!r}; "
                f"kvjax supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF in
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a ``config.json`` dict (or a ``transformers`` config object)."""
        if not isinstance(hf, Mapping):
            hf = hf.to_dict()
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type: unsupported architecture {model_type!r}; "
                f"kvjax supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json is missing required field {key!r}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {act!r}")
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"pretraining_tp: only 1 is supported, got {hf['pretraining_tp']}")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        if hf.get("head_dim") is None and hf["hidden_size"] % num_heads:
            raise ValueError(
                f"head_dim: absent, and hidden_size ({hf['hidden_size']}) is not divisible by "
                f"num_attention_heads ({num_heads})"
            )
        rope_theta, scaling = _rope_from_hf(hf)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )

    # ----------------------------------------------------------------- HF out
    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers`` loads into the matching class."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(rope_type="llama3", **dataclasses.asdict(self.rope_scaling))
        out: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM" if self.model_type == "qwen3" else "LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        elif self.mlp_bias:
            raise ValueError("mlp_bias: Qwen3 has no MLP bias")
        if self.model_type == "qwen3" and not self.qk_norm:
            raise ValueError("qk_norm: Qwen3 always uses q/k RMSNorm")
        return out


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read rotary settings from either ``rope_parameters`` (transformers 5) or the
    legacy ``rope_theta`` + ``rope_scaling`` fields."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r} (supported: default, llama3)")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"rope_scaling: llama3 scaling is missing {e.args[0]!r}") from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError("rope_scaling: high_freq_factor must exceed low_freq_factor")
    return theta, scaling


_LLAMA31_SCALING = RopeScaling(8.0, 1.0, 4.0, 8192)
_LLAMA32_SCALING = RopeScaling(32.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 1e6, None, 1e-6, True, True,
                              max_position_embeddings=40960, eos_token_id=151645),
    "qwen3-1.7b": ModelConfig("qwen3", 151936, 2048, 6144, 28, 16, 8, 128, 1e6, None, 1e-6, True, True,
                              max_position_embeddings=40960, eos_token_id=151645),
    "qwen3-4b": ModelConfig("qwen3", 151936, 2560, 9728, 36, 32, 8, 128, 1e6, None, 1e-6, True, True,
                            max_position_embeddings=40960, eos_token_id=151645),
    "qwen3-8b": ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e6, None, 1e-6, False, True,
                            max_position_embeddings=40960, eos_token_id=151645),
    "llama-3.1-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 5e5, _LLAMA31_SCALING, 1e-5,
                                False, max_position_embeddings=131072, bos_token_id=128000,
                                eos_token_id=128001),
    "llama-3.2-1b": ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, 5e5, _LLAMA32_SCALING, 1e-5,
                                True, max_position_embeddings=131072, bos_token_id=128000,
                                eos_token_id=128001),
    "llama-3.2-3b": ModelConfig("llama", 128256, 3072, 8192, 28, 24, 8, 128, 5e5, _LLAMA32_SCALING, 1e-5,
                                True, max_position_embeddings=131072, bos_token_id=128000,
                                eos_token_id=128001),
    # SmolLM2-135M-Instruct, the real model kvjax.real_model converts offline (make real-model);
    # its GGUF stores rms_norm_eps as float32(1e-5)
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e5, None, 9.999999747378752e-06, True,
                                max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
}


def preset(name: str) -> ModelConfig:
    """A published model's shapes (no weights)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: unknown model {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def config_hash(model_config: ModelConfig) -> str:
    """SHA-256 of a model's HF config fields (order-independent)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(model_config.to_hf_config(), sort_keys=True).encode()).hexdigest()
