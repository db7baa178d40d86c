"""Build the model a training config names: an HF folder, a preset, or inline fields."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from kvjax.config import ModelConfig, preset
from kvjax.convert.hf_io import load_hf
from kvjax.models.decoder import Decoder
from kvjax.train.config import ModelSection


def model_config(section: ModelSection) -> ModelConfig:
    if section.hf_path is not None:
        from kvjax.convert.hf_io import read_config

        return read_config(section.hf_path)
    if section.preset is not None:
        return preset(section.preset)
    return ModelConfig.from_hf_config(section.config)


def build_model(section: ModelSection, seed: int, *, abstract: bool = False) -> Decoder:
    """The model, randomly initialised (preset / inline) or loaded (hf_path)."""
    if section.hf_path is not None and not abstract:
        return load_hf(section.hf_path, dtype=section.param_dtype, compute_dtype=section.compute_dtype)
    cfg = model_config(section)

    def make():
        return Decoder(cfg, rngs=nnx.Rngs(seed), param_dtype=jnp.dtype(section.param_dtype),
                       dtype=jnp.dtype(section.compute_dtype), init_std=section.init_std,
                       embed_init_std=section.embed_init_std, qk_norm_init=section.qk_norm_init)

    return nnx.eval_shape(make) if abstract else make()
