"""Peak memory of the compiled future-attention target at S = 16,384 (XLA memory analysis):
the transposed, query-blocked pass against the dense reference that materialises p(d -> t)."""

import argparse

import jax
import jax.numpy as jnp

from kvjax.targets import dense_target, future_attention_target


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    a = ap.parse_args()
    q = jax.ShapeDtypeStruct((1, a.seq, a.heads, a.head_dim), jnp.float32)
    k = jax.ShapeDtypeStruct((1, a.seq, a.kv_heads, a.head_dim), jnp.float32)
    lse = jax.ShapeDtypeStruct((1, a.seq, a.heads), jnp.float32)
    for name, fn in [("transposed (blocks of 256 queries)", future_attention_target), ("dense reference", dense_target)]:
        compiled = jax.jit(lambda q, k, lse, fn=fn: fn(q, k, window=a.window, lse=lse)).lower(q, k, lse).compile()
        m = compiled.memory_analysis()
        peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
        print(f"S={a.seq} {name:<36} temp {m.temp_size_in_bytes / 2**20:10.1f} MiB   "
              f"args+out+temp {peak / 2**20:10.1f} MiB")


if __name__ == "__main__":
    main()
