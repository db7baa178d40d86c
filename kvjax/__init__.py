"""kvjax: learned KV-cache eviction (KVpop, LKV) for JAX/Flax language models."""

from kvjax.config import ModelConfig, RopeScaling, preset
from kvjax.convert.hf_io import load_hf, save_hf
from kvjax.eviction.bounded import AttentionStatistic, StaticPriority
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.keep_rule import keep_mask
from kvjax.eviction.policies import REGISTRY as POLICIES
from kvjax.eviction.policies import make_policy, register
from kvjax.eviction.prompt_compressed import prompt_compressed
from kvjax.export import export_scorers, load_scorers
from kvjax.generate import forward, generate
from kvjax.lkv import soft_topk
from kvjax.models.decoder import Decoder
from kvjax.targets import future_attention_target
from kvjax.text import TextGenerator, generate_text

Model = Decoder


def __getattr__(name):
    # kvjax.real_model on first use, so `python -m kvjax.real_model` runs it once, not imported twice
    if name == "real_model":
        import importlib

        return importlib.import_module("kvjax.real_model")
    raise AttributeError(f"module 'kvjax' has no attribute {name!r}")

__all__ = ["ModelConfig", "RopeScaling", "preset", "load_hf", "save_hf", "forward", "generate", "Decoder", "Model",
           "EvictionConfig", "StaticPriority", "AttentionStatistic", "make_policy", "prompt_compressed", "register", "POLICIES", "future_attention_target", "soft_topk", "keep_mask",
           "export_scorers", "load_scorers", "TextGenerator", "generate_text", "real_model"]
