"""Jitted decode speed and memory at long generation lengths: kvjax's dense cache, KVpop's
bounded cache, and ``transformers`` (PyTorch) with the same weights.

Decoding at length ``L`` costs what the cache holds, not how it got there: the dense
cache attends over its ``L + n`` slots every step and the bounded cache over its fixed
``s + w + k`` slots. So each measurement starts from an initialised cache and decodes
``n`` tokens at positions ``L .. L + n - 1`` in one jitted ``lax.fori_loop`` (the
``generate`` step: forward one token, append to the cache, argmax); compilation is timed
apart. ``transformers`` gets a ``DynamicCache`` of ``L`` zero keys/values and ``generate``
continues from it. Every (implementation, length, batch) runs in a fresh process, so its
peak RSS is its own.
"""

from __future__ import annotations

import functools
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BENCH_MODEL = {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
               "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
               "max_position_embeddings": 1 << 18, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def make_bench_model(directory: Path, preset: str | None = None) -> Path:
    """Random weights for the benchmark shapes (or a preset's), saved as an HF folder."""
    import jax.numpy as jnp
    from flax import nnx

    import kvjax

    if (directory / "config.json").exists():
        return directory
    cfg = kvjax.preset(preset) if preset else kvjax.ModelConfig.from_hf_config(BENCH_MODEL)
    model = kvjax.Decoder(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16 if preset else jnp.float32,
                          init_std=0.02)
    kvjax.save_hf(model, directory)
    return directory


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``; ``ru_maxrss`` would carry the parent's over ``exec``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def copy_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Measured memory-copy bandwidth in bytes/s (read + write counted), median of runs."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(times))


def _kvjax_policy(kind: str, cfg, budget: int):
    from flax import nnx

    from kvjax.eviction.config import EvictionConfig
    from kvjax.eviction.learned import from_scorer
    from kvjax.cache import DenseKV
    from kvjax.scorers import MLSTMScorer

    if kind == "dense":
        return DenseKV()
    window = max(1, budget // 16)
    ev = EvictionConfig(sinks=4, window=window, topk=budget - 4 - window)
    if kind == "kvpop":
        return from_scorer(MLSTMScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, rngs=nnx.Rngs(0)), ev)
    from kvjax.eviction.policies import make_policy

    return make_policy(kind, ev)         # a weightless policy by name (knorm, streaming_llm, ...): ablations


def run_kvjax(model_dir: str, kind: str, length: int, batch: int, steps: int, repeats: int, budget: int) -> dict:
    import kvjax

    return time_kvjax_decode(kvjax.load_hf(model_dir), kind, length, batch, steps, repeats, budget)


def time_kvjax_decode(model, kind: str, length: int, batch: int, steps: int, repeats: int, budget: int) -> dict:
    """Seconds per decode step of ``model`` with the dense cache or KVpop's bounded one
    (``kind``: dense | kvpop | a weightless policy's name), starting at ``length`` tokens, ``steps`` steps in one jit."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kvjax import decode

    cfg = model.config
    policy = _kvjax_policy(kind, cfg, budget)
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def run(params, pparams, state):
        m = nnx.merge(graphdef, params)
        attend = decode.bind(policy, pparams)

        def step(i, st):
            logits, st = decode.decode_step(m, attend, st)
            return st.replace(token=jnp.argmax(logits, -1).astype(jnp.int32))

        return jax.lax.fori_loop(0, steps, step, state)

    def fresh():
        return decode.open_state(model, policy, policy.params, batch, length + steps, jnp.full((batch,), length),
                                 position_B=jnp.full((batch,), length, jnp.int32)).replace(
                                     token=jnp.ones((batch,), jnp.int32))

    state = fresh()
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.cache))
    t = time.perf_counter()
    jax.block_until_ready(run(params, policy.params, state))
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        state = fresh()
        jax.block_until_ready(state)
        t = time.perf_counter()
        jax.block_until_ready(run(params, policy.params, state))
        times.append((time.perf_counter() - t) / steps)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    return {"impl": f"kvjax-{kind}", "length": length, "batch": batch, "latency_s": float(np.median(times)),
            "compile_s": compile_s, "cache_bytes": int(cache_bytes), "weight_bytes": int(weight_bytes),
            "peak_rss_bytes": peak_rss_bytes()}


def run_transformers(model_dir: str, length: int, batch: int, steps: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    c = model.config
    head_dim = getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)

    def cache():
        kv = DynamicCache()
        for layer in range(c.num_hidden_layers):
            z = torch.zeros(batch, c.num_key_value_heads, length, head_dim)
            kv.update(z, z.clone(), layer)
        return kv

    ids = torch.ones(batch, length + 1, dtype=torch.long)
    times = []
    with torch.no_grad():
        for r in range(repeats + 1):
            kv = cache()
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=kv, max_new_tokens=steps,
                                 min_new_tokens=steps, do_sample=False, pad_token_id=0)
            if r:
                times.append((time.perf_counter() - t) / steps)
    assert out.shape[1] == length + 1 + steps
    cache_bytes = 2 * c.num_hidden_layers * batch * c.num_key_value_heads * (length + steps) * head_dim * 4
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"impl": "transformers-dense", "length": length, "batch": batch, "latency_s": float(np.median(times)),
            "compile_s": 0.0, "cache_bytes": int(cache_bytes), "weight_bytes": int(weight_bytes),
            "peak_rss_bytes": peak_rss_bytes()}


def run_one(spec: dict) -> dict:
    """One measurement in this process (the ``--one`` entry point of ``eval.py bench``)."""
    if spec["impl"] == "transformers-dense":
        return run_transformers(spec["model"], spec["length"], spec["batch"], spec["steps"], spec["repeats"])
    return run_kvjax(spec["model"], spec["impl"].split("-", 1)[1], spec["length"], spec["batch"], spec["steps"],
                     spec["repeats"], spec["budget"])


def run_isolated(spec: dict, timeout: int = 3600) -> dict:
    """``run_one`` in a fresh Python process; an out-of-memory or crash is reported, not raised."""
    res = subprocess.run([sys.executable, "-m", "kvjax.evaluation.decode_bench", json.dumps(spec)],
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        return {**{k: spec[k] for k in ("impl", "length", "batch")}, "error": res.stderr.strip().splitlines()[-1:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def with_bandwidth(row: dict, bandwidth: float) -> dict:
    """Bytes one decode step must read (weights + the cache) as a fraction of copy bandwidth."""
    if "latency_s" not in row:
        return row
    moved = row["weight_bytes"] + row["cache_bytes"]
    return {**row, "tokens_per_s": row["batch"] / row["latency_s"], "bytes_per_step": moved,
            "bandwidth_fraction": moved / row["latency_s"] / bandwidth}


def markdown(rows: list[dict]) -> str:
    out = ["| impl | batch | length | ms/token | tokens/s | KV cache MiB | peak RSS MiB | of copy bandwidth | compile s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['impl']} | {r['batch']} | {r['length']} | failed: {r['error']} | | | | | |")
            continue
        out.append(f"| {r['impl']} | {r['batch']} | {r['length']} | {r['latency_s'] * 1e3:.2f} | "
                   f"{r['tokens_per_s']:.1f} | {r['cache_bytes'] / 2**20:.1f} | {r['peak_rss_bytes'] / 2**20:.0f} | "
                   f"{r['bandwidth_fraction']:.0%} | {r['compile_s']:.1f} |")
    return "\n".join(out) + "\n"


def speedups(rows: list[dict]) -> list[dict]:
    """Per (batch, length): KVpop-bounded vs dense kvjax tokens/s (measured, and the ideal
    ratio of bytes one step moves, dense / bounded), and dense kvjax vs ``transformers``."""
    by = {(r["impl"], r["batch"], r["length"]): r for r in rows if "latency_s" in r}
    out = []
    for batch, length in sorted({(b, n) for _, b, n in by}):
        dense, kvpop = by.get(("kvjax-dense", batch, length)), by.get(("kvjax-kvpop", batch, length))
        hf = by.get(("transformers-dense", batch, length))
        row = {"batch": batch, "length": length}
        if dense and kvpop:
            row["kvpop_vs_dense"] = dense["latency_s"] / kvpop["latency_s"]
            row["kvpop_vs_dense_ideal"] = dense["bytes_per_step"] / kvpop["bytes_per_step"]
        if dense and hf:
            row["dense_vs_transformers"] = hf["latency_s"] / dense["latency_s"]
        out.append(row)
    return out


def speedup_markdown(rows: list[dict]) -> str:
    out = ["| batch | length | KVpop vs dense (measured) | ideal (bytes/step, dense / bounded) | "
           "dense kvjax vs transformers |", "|---|---|---|---|---|"]

    def cell(v):
        return f"{v:.2f}x" if v is not None else "-"

    for r in speedups(rows):
        out.append(f"| {r['batch']} | {r['length']} | {cell(r.get('kvpop_vs_dense'))} | "
                   f"{cell(r.get('kvpop_vs_dense_ideal'))} | {cell(r.get('dense_vs_transformers'))} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for impl in sorted({r["impl"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows}):
            pts = sorted((r["length"], r) for r in rows if r["impl"] == impl and r["batch"] == batch and "latency_s" in r)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            a.plot(xs, [p[1]["latency_s"] * 1e3 for p in pts], marker="o", label=f"{impl}, batch {batch}")
            b.plot(xs, [p[1]["cache_bytes"] / 2**20 for p in pts], marker="o", label=f"{impl}, batch {batch}")
    for ax, title, unit in ((a, "decode latency", "ms / step"), (b, "KV cache", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("generation length (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    print(json.dumps(run_one(json.loads(sys.argv[1]))))
