"""kvjax: learned KV-cache eviction (KVpop, LKV) for JAX/Flax language models."""

from kvjax.config import ModelConfig, RopeScaling, preset
from kvjax.convert.hf_io import load_hf, save_hf
from kvjax.generate import forward, generate
from kvjax.models.decoder import Decoder

Model = Decoder

__all__ = ["ModelConfig", "RopeScaling", "preset", "load_hf", "save_hf", "forward", "generate",
           "Decoder", "Model"]
