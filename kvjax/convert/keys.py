"""One invertible key table per architecture: HF tensor name <-> kvjax parameter path.

Each rule names the HF key, our NNX state path, and a layout transform with its
exact inverse; the same table drives :func:`kvjax.load_hf` and :func:`kvjax.save_hf`.
``torch.nn.Linear`` stores ``[out, in]``; kvjax stores ``[in, ...out]`` with heads split:

| transform   | HF layout      | kvjax layout  |
|-------------|----------------|---------------|
| ``copy``    | any            | same          |
| ``linear``  | ``[out, in]``  | ``[in, out]`` |
| ``in_heads``| ``[N*D, E]``   | ``[E, N, D]`` |
| ``bias_heads`` | ``[N*D]``   | ``[N, D]``    |
| ``out_heads`` | ``[E, H*D]`` | ``[H, D, E]`` |
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from kvjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Transform:
    to_ours: Callable[[np.ndarray, tuple], np.ndarray]   # (hf array, our shape) -> our array
    to_hf: Callable[[np.ndarray], np.ndarray]            # our array -> hf array
    hf_shape: Callable[[tuple], tuple]                   # our shape -> hf shape


COPY = Transform(lambda a, s: a, lambda a: a, lambda s: tuple(s))
LINEAR = Transform(lambda a, s: a.T, lambda a: a.T, lambda s: (s[1], s[0]))
IN_HEADS = Transform(lambda a, s: a.T.reshape(s), lambda a: a.reshape(a.shape[0], -1).T,
                     lambda s: (s[1] * s[2], s[0]))
BIAS_HEADS = Transform(lambda a, s: a.reshape(s), lambda a: a.reshape(-1), lambda s: (s[0] * s[1],))
OUT_HEADS = Transform(lambda a, s: a.T.reshape(s), lambda a: a.reshape(-1, a.shape[-1]).T,
                      lambda s: (s[2], s[0] * s[1]))


@dataclasses.dataclass(frozen=True)
class KeyRule:
    hf: str          # HF name, ``{i}`` = layer index
    ours: str        # dotted NNX state path, ``{i}`` = layer index
    transform: Transform
    when: Callable[[ModelConfig], bool] = lambda cfg: True


_ALWAYS = [
    KeyRule("model.embed_tokens.weight", "embed_tokens", COPY),
    KeyRule("model.norm.weight", "norm", COPY),
    KeyRule("lm_head.weight", "lm_head", COPY, lambda c: not c.tie_word_embeddings),
    KeyRule("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm", COPY),
    KeyRule("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_layernorm", COPY),
    KeyRule("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.self_attn.q_proj", IN_HEADS),
    KeyRule("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.k_proj", IN_HEADS),
    KeyRule("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.self_attn.v_proj", IN_HEADS),
    KeyRule("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.self_attn.o_proj", OUT_HEADS),
    KeyRule("model.layers.{i}.self_attn.q_proj.bias", "layers.{i}.self_attn.q_bias", BIAS_HEADS,
            lambda c: c.attention_bias),
    KeyRule("model.layers.{i}.self_attn.k_proj.bias", "layers.{i}.self_attn.k_bias", BIAS_HEADS,
            lambda c: c.attention_bias),
    KeyRule("model.layers.{i}.self_attn.v_proj.bias", "layers.{i}.self_attn.v_bias", BIAS_HEADS,
            lambda c: c.attention_bias),
    KeyRule("model.layers.{i}.self_attn.o_proj.bias", "layers.{i}.self_attn.o_bias", COPY,
            lambda c: c.attention_bias),
    KeyRule("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_proj", LINEAR),
    KeyRule("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up_proj", LINEAR),
    KeyRule("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj", LINEAR),
]

_QK_NORM = [
    KeyRule("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.self_attn.q_norm", COPY),
    KeyRule("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.self_attn.k_norm", COPY),
]

_MLP_BIAS = [
    KeyRule(f"model.layers.{{i}}.mlp.{n}_proj.bias", f"layers.{{i}}.mlp.{n}_bias", COPY,
            lambda c: c.mlp_bias) for n in ("gate", "up", "down")
]

KEY_TABLES: dict[str, list[KeyRule]] = {
    "qwen3": _ALWAYS + _QK_NORM,
    "llama": _ALWAYS + _MLP_BIAS,
}

# Tensors some HF checkpoints carry that hold no parameters of ours.
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


def expand_table(cfg: ModelConfig) -> dict[str, tuple[str, Transform]]:
    """``{our dotted path: (hf key, transform)}`` for every parameter of this config."""
    out = {}
    for rule in KEY_TABLES[cfg.model_type]:
        if not rule.when(cfg):
            continue
        layers = range(cfg.num_layers) if "{i}" in rule.ours else [None]
        for i in layers:
            ours = rule.ours.format(i=i) if i is not None else rule.ours
            hf = rule.hf.format(i=i) if i is not None else rule.hf
            out[ours] = (hf, rule.transform)
    return out
