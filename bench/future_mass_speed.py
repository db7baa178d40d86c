"""``pallas_kernels.reference.future_log_mass`` (the oracle's and KVpop's training target's future
attention mass) at one layer of SmolLM2's shapes, against the same function at another git
revision, in one run.

    python bench/future_mass_speed.py --against 6cb124e [--batch 4] [--length 4096] [--repeats 3]

Random queries and keys (``[B, S, 9, 64]`` and ``[B, S, 3, 64]``), ``window=32``, ``reduce="sum"``,
jitted; prints the median seconds of ``--repeats`` calls after the compile and the largest
difference of the results.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def _module_at(rev: str):
    """``pallas_kernels/reference.py`` as it was at git revision ``rev``, loaded as its own module
    (its imports of other ``pallas_kernels`` modules come from this checkout)."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:pallas_kernels/reference.py"],
                         capture_output=True, text=True)
    if src.returncode:
        raise SystemExit(f"--against {rev}: {src.stderr.strip()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reference_at_rev.py"
        path.write_text(src.stdout)
        spec = importlib.util.spec_from_file_location("reference_at_rev", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="a git revision whose future_log_mass to time beside")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.reference import future_log_mass

    old_mod = _module_at(args.against)
    rng = np.random.default_rng(0)
    B, S = args.batch, args.length
    q = jnp.asarray(rng.normal(size=(B, S, 9, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, S, 3, 64)), jnp.float32)
    lse = jnp.asarray(rng.normal(size=(B, S, 9)) + 4.0, jnp.float32)
    runs = {f"at {args.against}": jax.jit(lambda q, k, lse: old_mod.future_log_mass(q, k, window=32, lse_BSH=lse)),
            "this checkout": jax.jit(lambda q, k, lse: future_log_mass(q, k, window=32, lse_BSH=lse))}
    out, med = {}, {}
    for name, fn in runs.items():
        out[name] = np.asarray(fn(q, k, lse))                        # compiles
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, k, lse))
            times.append(time.perf_counter() - t0)
        med[name] = statistics.median(times)
    (a, ta), (b, tb) = med.items()
    print(f"B={B}, S={S}, one layer (9 query heads, 3 KV heads, D=64)")
    print(f"future_log_mass {a:<20} {ta:7.3f} s")
    print(f"future_log_mass {b:<20} {tb:7.3f} s   ({ta / tb:.2f}x)")
    x, y = out.values()
    f = np.isfinite(x)
    print(f"largest difference {np.max(np.abs(x[f] - y[f])):.2e}; same -inf entries: "
          f"{bool(np.array_equal(np.isfinite(x), np.isfinite(y)))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
