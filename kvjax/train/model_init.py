"""Build the model a training config names: an HF folder, a preset, or inline fields."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from kvjax.config import ModelConfig, preset
from kvjax.convert.hf_io import load_hf
from kvjax.models.decoder import Decoder
from kvjax.train.config import ModelSection


def model_config(section: ModelSection, *, need_weights: bool = True) -> ModelConfig:
    """The model's shapes; an absent ``hf_path`` falls back to its ``preset`` when weights
    are not needed (dry runs)."""
    if section.hf_path is not None and (need_weights or section.preset is None or Path(section.hf_path).exists()):
        from kvjax.convert.hf_io import read_config

        cfg = read_config(section.hf_path)
        if section.preset is not None and cfg != preset(section.preset).replace(
                bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id):
            raise ValueError(f"model.hf_path {section.hf_path} does not have the shapes of model.preset "
                             f"{section.preset!r}")
        return cfg
    if section.preset is not None:
        return preset(section.preset)
    return ModelConfig.from_hf_config(section.config)


def build_model(section: ModelSection, seed: int, *, abstract: bool = False) -> Decoder:
    """The model, randomly initialised (preset / inline) or loaded (hf_path)."""
    if section.hf_path is not None and not abstract:
        model_config(section)      # checks the folder against model.preset, if given
        model = load_hf(section.hf_path, dtype=section.param_dtype, compute_dtype=section.compute_dtype)
    else:
        cfg = model_config(section, need_weights=not abstract)

        def make():
            return Decoder(cfg, rngs=nnx.Rngs(seed), param_dtype=jnp.dtype(section.param_dtype),
                           dtype=jnp.dtype(section.compute_dtype), init_std=section.init_std,
                           embed_init_std=section.embed_init_std, qk_norm_init=section.qk_norm_init)

        model = nnx.eval_shape(make) if abstract else make()
    model.remat = section.remat
    return model
