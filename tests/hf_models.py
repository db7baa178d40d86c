"""Tiny randomly initialised ``transformers`` models saved with ``save_pretrained``."""

from __future__ import annotations

import torch
import transformers

QWEN3_CASES = {
    "qwen3-gqa": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen3-mqa-tied": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
    "qwen3-headdim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True),
    "qwen3-mha": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8),
}
LLAMA_CASES = {
    "llama-gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "llama-mqa-llama3rope": dict(num_attention_heads=4, num_key_value_heads=1, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    "llama-headdim-tied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               tie_word_embeddings=True),
    "llama-bias": dict(num_attention_heads=2, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
}


def make_hf_model(name: str, seed: int = 0, init_std: float = 0.02) -> transformers.PreTrainedModel:
    extra = dict(QWEN3_CASES.get(name) or LLAMA_CASES[name], initializer_range=init_std)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if name.startswith("qwen3"):
        cfg = transformers.Qwen3Config(**common, rope_theta=10000.0, **extra)
        cls = transformers.Qwen3ForCausalLM
    else:
        rope = extra.pop("rope_scaling", None)
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, **extra)
        if rope is not None:
            cfg.rope_parameters = {"rope_theta": 500000.0, **rope}
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():   # make norms and biases non-trivial so the test can see them
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_hf_model(name: str, path, **kw) -> transformers.PreTrainedModel:
    model = make_hf_model(name)
    model.save_pretrained(path, **kw)
    return model
