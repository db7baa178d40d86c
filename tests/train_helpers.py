"""A tiny pretrain config for trainer tests."""

from kvjax.configio import from_dict
from kvjax.train.config import TrainConfig

TINY_MODEL = {"model_type": "qwen3", "vocab_size": 299, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1}


def tiny_config(out_dir, **over) -> TrainConfig:
    d = {"mode": "pretrain", "out_dir": str(out_dir), "steps": 30, "seed": 3,
         "model": {"config": TINY_MODEL, "embed_init_std": 1.0},
         "data": {"testbed": {"length": 128, "num_names": 8}, "seq_len": 128, "batch_size": 8,
                  "eval_problems": 0},
         "optim": {"lr": 3e-3, "warmup_steps": 5},
         "log": {"every": 5, "tensorboard": False},
         "checkpoint": {"every": 0, "keep": 2}}
    for k, v in over.items():
        node = d
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return from_dict(TrainConfig, d)
