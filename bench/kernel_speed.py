"""Each ``pallas_kernels`` op against its XLA reference, in one run, on whatever device JAX sees:

    python bench/kernel_speed.py                  # S = 4k, 16k, 64k; budget 2048; Qwen3-8B-like heads
    python bench/kernel_speed.py --lengths 1024 2048 --heads 4 --kv-heads 2 --head-dim 64   # a quick CPU check

Per sequence length: median seconds (after compilation) of the sparse attention forward,
forward + backward, the transposed target and one decode step over a budget-``B`` cache,
for the kernel backend and the XLA reference, and their ratio. Budget ``B`` = 4 sinks +
``B / 16`` window + the rest long-range (the recipes' proportions). A reference that does
not fit in memory (it materialises ``S x S`` masks) is reported as ``OOM``. On a CPU the
kernel backend is the reference itself unless ``--interpret`` is given (interpret mode is
for correctness, not speed). Writes ``--out`` (JSON) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from timing import median_seconds
from kvjax.eviction import compact_keep


def timed(fn, repeats: int) -> float | str:
    """Median seconds, or why there is no figure (a reference that runs out of memory)."""
    try:
        return median_seconds(fn, repeats)
    except (jax.errors.JaxRuntimeError, MemoryError, RuntimeError) as e:  # out of memory, mostly
        return "OOM" if "memory" in str(e).lower() or isinstance(e, MemoryError) else f"error: {str(e)[:80]}"


def bench_length(S: int, args, kernel: str) -> dict:
    rs = np.random.RandomState(0)
    B, H, K, D = args.batch, args.heads, args.kv_heads, args.head_dim
    dt = jnp.dtype(args.dtype)
    q = jnp.asarray(rs.randn(B, S, H, D), dt)
    k = jnp.asarray(rs.randn(B, S, K, D), dt)
    v = jnp.asarray(rs.randn(B, S, K, D), dt)
    window = max(1, args.budget // 16)
    sinks, topk = 4, args.budget - 4 - window
    ck = compact_keep(jnp.asarray(rs.randn(B, K, S), jnp.float32), sinks=sinks, window=window, topk=topk,
                      block_q=args.block, block_k=args.block)
    kw = dict(sinks=sinks, window=window)
    row = {"S": S, "kept_blocks": float(np.asarray(ck.block_any_kept).mean())}
    for name, be in (("kernel", kernel), ("xla", "xla")):
        opt = dict(backend=be, interpret=args.interpret and be != "xla")
        blk = dict(block_q=args.block, block_k=args.block) if be != "xla" else {}
        fwd = jax.jit(lambda q, k, v: pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, **kw, **opt, **blk))
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
            pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, **kw, **opt, **blk)[0].astype(jnp.float32)),
            argnums=(0, 1, 2)))
        row[f"fwd_{name}"] = timed(lambda: fwd(q, k, v), args.repeats)
        row[f"fwd_bwd_{name}"] = timed(lambda: grad(q, k, v), args.repeats)
        lse = jnp.zeros((B, S, H), jnp.float32) + jnp.log(jnp.float32(S))
        tgt = jax.jit(lambda q, k, lse: pk.transposed_target(q, k, lse, window=window, **opt, **blk))
        row[f"target_{name}"] = timed(lambda: tgt(q, k, lse), args.repeats)
        N = args.budget
        qd = q[:, -1]
        kd, vd = jnp.asarray(rs.randn(B, K, N, D), dt), jnp.asarray(rs.randn(B, K, N, D), dt)
        valid = jnp.ones((B, K, N), bool)
        dec = jax.jit(lambda q, k, v, m: pk.sparse_decode(q, k, v, m, **opt))
        row[f"decode_{name}"] = timed(lambda: dec(qd, kd, vd, valid), args.repeats)
    return row


def markdown(rows: list[dict], device: str, kernel: str) -> str:
    def cell(x):
        return x if isinstance(x, str) else f"{x * 1e3:.2f}"

    def ratio(a, b):
        return f"{b / a:.2f}x" if not isinstance(a, str) and not isinstance(b, str) else "-"

    lines = [f"Device: {device}; kernel backend: {kernel}. Milliseconds (median); ratio = XLA / kernel.", "",
             "| S | op | kernel ms | XLA ms | speed-up |", "|---|---|---|---|---|"]
    for r in rows:
        for op in ("fwd", "fwd_bwd", "target", "decode"):
            lines.append(f"| {r['S']} | {op} | {cell(r[op + '_kernel'])} | {cell(r[op + '_xla'])} | "
                         f"{ratio(r[op + '_kernel'], r[op + '_xla'])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--backend", default="auto", choices=pk.BACKENDS)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="runs/kernel_speed.json")
    args = ap.parse_args(argv)
    kernel = pk.resolve_backend(args.backend)
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    rows = []
    for S in args.lengths:
        rows.append(bench_length(S, args, kernel))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "kernel": kernel, "args": vars(args), "rows": rows},
                                         indent=2))
    print(markdown(rows, device, kernel))


if __name__ == "__main__":
    main()
