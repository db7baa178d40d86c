"""``make demo``: the end-to-end path that exists today, on a tiny random Qwen3.

Builds a tiny model, writes it as a Hugging Face folder, loads it back with
``kvjax.load_hf``, checks the logits against ``transformers`` when it is installed,
generates with the jitted dense decoder, then with bounded caches under a few policies.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import kvjax


def main(out_dir: str | None = None) -> None:
    out = Path(out_dir or tempfile.mkdtemp(prefix="kvjax-demo-")) / "tiny-qwen3"
    cfg = kvjax.ModelConfig("qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, eos_token_id=1,
                            max_position_embeddings=1024)
    print(f"[1/4] tiny Qwen3 ({cfg.num_layers} layers, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads) "
          f"-> Hugging Face folder {out}")
    kvjax.save_hf(kvjax.Decoder(cfg, rngs=nnx.Rngs(0), init_std=0.2), out)
    model = kvjax.load_hf(out)
    tokens = np.random.RandomState(0).randint(2, 512, (2, 32))
    logits = np.asarray(kvjax.forward(model, tokens))
    try:
        import torch
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            diff = np.abs(ref(torch.tensor(tokens)).logits.numpy() - logits).max()
        print(f"[2/4] load_hf round trip: max |logits - transformers| = {diff:.2e}")
    except ImportError:
        print("[2/4] transformers/torch not installed: parity check skipped")
    prompts = [tokens[0, :9].tolist(), tokens[1, :20].tolist()]
    t0 = time.perf_counter()
    jax.block_until_ready(kvjax.generate(model, prompts, 64, eos_token_id=[]))
    t1 = time.perf_counter()
    outs = np.asarray(kvjax.generate(model, prompts, 64, eos_token_id=[]))
    t2 = time.perf_counter()
    print(f"[3/4] jitted greedy generate, 2 prompts (9 and 20 tokens) + 64 new tokens: "
          f"compile+run {t1 - t0:.2f}s, run {1e3 * (t2 - t1):.1f} ms")
    for b, row in enumerate(outs):
        print(f"   row {b}: ... {row[-16:].tolist()}")
    ev = kvjax.EvictionConfig(sinks=4, window=8, topk=20)
    print(f"[4/4] bounded KV cache, {ev.budget} slots per KV head (dense: up to {20 + 64}); "
          f"share of new tokens equal to dense generation:")
    for name in ("streaming_llm", "h2o", "tova", "knorm"):
        got = np.asarray(kvjax.generate(model, prompts, 64, policy=kvjax.make_policy(name, ev), eos_token_id=[]))
        print(f"   {name:<14} {np.mean(got[:, -64:] == outs[:, -64:]):.0%}")


if __name__ == "__main__":
    main()
