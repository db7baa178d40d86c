"""One prepared check of kvjax on an accelerator: correctness, kernel speed, decode, a train step.

    python bench/device_check.py --out runs/device-check            # on a GPU/TPU: ~11 minutes
    python bench/device_check.py --smoke --out /tmp/dc               # tiny sizes, CPU, interpret mode, < 3 min

Runs from a copy of the source tree (no install: the repository root goes on ``sys.path``)
under whatever jax/flax/optax the machine has; grain is not needed. Each section runs in
its own process with its own time box and fails soft (its error is recorded, the next
section runs), so one broken kernel does not cost the other figures:

- ``env``: jax version, backend, device kind and memory;
- ``correctness``: ``sparse_attention`` forward + gradients, ``transposed_target`` and
  ``sparse_decode`` on the platform's kernels against their XLA references, fp32 and bf16,
  at S = 4096, with the interpret-mode tests' tolerances;
- ``kernels``: each op against its XLA reference at S = 4k, 16k, 64k, budget 2048 (medians;
  ``OOM`` recorded, not raised) -- ``bench/kernel_speed.py``;
- ``decode``: Qwen3-8B shapes, random bf16 weights, batch 1: dense vs KVpop's bounded cache
  (budget 4096 per KV head) at 8k, 32k and 131k context, ms/token and peak device memory
  (the KVpop seed's Figure 4);
- ``longgen``: 2,048 tokens generated from a short prompt, batch 1 and 8, dense vs bounded at 75%
  (``kvjax.evaluation.long_generation``): Qwen3-8B shapes (random bf16), SmolLM2 if on the machine;
- ``distill``: one ``distill_kvpop`` step at Qwen3-0.6B shapes, seq 4096, with the Pallas
  kernels and with the XLA reference path: step time and peak device memory.

Writes ``device_check.json`` and ``device_check.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

SECTIONS = ("env", "correctness", "kernels", "decode", "longgen", "distill")
TIME_BOX = {"env": 60, "correctness": 90, "kernels": 120, "decode": 150, "longgen": 150, "distill": 90}  # s; ~11 min
SMOKE_TIME_BOX = 150


def _peak_bytes():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _err(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


# ---- sections -------------------------------------------------------------------------------
def section_env(smoke: bool) -> dict:
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    out = {"jax": jax.__version__, "backend": jax.default_backend(), "device_kind": dev.device_kind,
           "device_count": jax.device_count(), "memory_bytes": stats.get("bytes_limit"),
           "python": sys.version.split()[0]}
    for mod in ("jaxlib", "flax", "optax", "orbax.checkpoint", "transformers", "grain"):
        try:
            out[mod] = __import__(mod, fromlist=["_"]).__version__
        except Exception as e:  # noqa: BLE001 - absent packages are a finding, not an error
            out[mod] = f"absent ({type(e).__name__})"
    return out


def _kernel_backend(smoke: bool) -> tuple[str, bool]:
    import pallas_kernels as pk

    backend = pk.resolve_backend("auto")
    if backend == "xla":           # a CPU: exercise the GPU kernels in interpret mode
        return "gpu", True
    return backend, False


def section_correctness(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from kvjax.eviction import compact_keep
    from pallas_kernels import reference

    backend, interpret = _kernel_backend(smoke)
    S = 256 if smoke else 4096
    blk = 128 if backend == "tpu" else (32 if smoke else 64)
    B, K, G, D = 1, 2, 2, 64
    sinks, window, topk = 4, S // 16, S // 4
    tol = {"float32": dict(fwd=2e-5, lse=2e-5, grad=1e-4, target=1e-5, decode=2e-5),
           "bfloat16": dict(fwd=2e-2, lse=1e-2, grad=5e-2, target=1e-2, decode=2e-2)}
    out = {"backend": backend, "interpret": interpret, "S": S, "checks": []}
    rs = np.random.RandomState(0)
    for dt in ("float32", "bfloat16"):
        q = jnp.asarray(rs.randn(B, S, G * K, D), dt)
        k = jnp.asarray(rs.randn(B, S, K, D), dt)
        v = jnp.asarray(rs.randn(B, S, K, D), dt)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        ck = compact_keep(jnp.asarray(rs.randn(B, K, S), jnp.float32), sinks=sinks, window=window, topk=topk,
                          block_q=blk, block_k=blk)
        kw = dict(sinks=sinks, window=window)
        opt = dict(backend=backend, interpret=interpret, block_q=blk, block_k=blk)

        def record(name, err, limit):
            out["checks"].append({"dtype": dt, "check": name, "max_abs_err": err, "tol": limit, "ok": err <= limit})

        o, lse = jax.jit(lambda q, k, v: pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, **kw, **opt))(q, k, v)
        ro, rlse = reference.sparse_attention(*f32, ck.rank, ck.cutoff, **kw)
        record("sparse_attention out", _err(o, ro), tol[dt]["fwd"])
        record("sparse_attention lse", _err(lse, rlse), tol[dt]["lse"])

        def loss(fn):
            return lambda q, k, v: jnp.sum(fn(q, k, v)[0].astype(jnp.float32) ** 2) / S

        g = jax.jit(jax.grad(loss(lambda q, k, v: pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, **kw, **opt)),
                             (0, 1, 2)))(q, k, v)
        rg = jax.grad(loss(lambda q, k, v: reference.sparse_attention(q, k, v, ck.rank, ck.cutoff, **kw)),
                      (0, 1, 2))(*f32)
        for name, a, b in zip(("dq", "dk", "dv"), g, rg):
            scale = max(1.0, float(np.max(np.abs(np.asarray(b)))))
            record(f"sparse_attention {name} (relative)", _err(a, b) / scale, tol[dt]["grad"])
        t = jax.jit(lambda q, k, lse: pk.transposed_target(q, k, lse, window=window, **opt))(q, k, rlse)
        rt = reference.transposed_target(*f32[:2], rlse, window=window)
        fin = np.isfinite(np.asarray(rt))
        record("transposed_target", _err(np.asarray(t)[fin], np.asarray(rt)[fin]), tol[dt]["target"])
        N = 2048 if not smoke else 128
        kd, vd = (jnp.asarray(rs.randn(B, K, N, D), dt) for _ in range(2))
        valid = jnp.asarray(rs.rand(B, K, N) < 0.9)
        d = jax.jit(lambda q, k, v, m: pk.sparse_decode(q, k, v, m, backend=backend, interpret=interpret))(
            q[:, -1], kd, vd, valid)
        rd = reference.sparse_decode(q[:, -1].astype(jnp.float32), kd.astype(jnp.float32),
                                     vd.astype(jnp.float32), valid)
        record("sparse_decode", _err(d, rd), tol[dt]["decode"])
    out["all_ok"] = all(c["ok"] for c in out["checks"])
    return out


def section_kernels(smoke: bool) -> dict:
    import kernel_speed as kbench

    backend, interpret = _kernel_backend(smoke)
    lengths = [256, 512] if smoke else [4096, 16384, 65536]
    args = argparse.Namespace(batch=1, heads=32 if not smoke else 4, kv_heads=8 if not smoke else 2,
                              head_dim=128 if not smoke else 64, dtype="bfloat16", budget=2048 if not smoke else 64,
                              block=128 if backend == "tpu" else (32 if smoke else 64), repeats=3 if not smoke else 1,
                              interpret=interpret)
    rows = []
    for S in lengths:
        try:
            rows.append(kbench.bench_length(S, args, backend))
        except Exception as e:  # noqa: BLE001 - one length failing leaves the others
            rows.append({"S": S, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return {"backend": backend, "interpret": interpret, "rows": rows}


def section_decode(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import kvjax
    from kvjax.evaluation.decode_bench import BENCH_MODEL, time_kvjax_decode

    if smoke:
        cfg = kvjax.ModelConfig.from_hf_config({**BENCH_MODEL, "num_hidden_layers": 2, "hidden_size": 128,
                                                "intermediate_size": 256, "vocab_size": 512})
        lengths, budget, steps = [128, 256], 64, 4
    else:
        cfg = kvjax.preset("qwen3-8b").replace(max_position_embeddings=1 << 18)
        lengths, budget, steps = [8192, 32768, 131072], 4096, 16
    dtype = jnp.bfloat16
    model = kvjax.Decoder(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype)
    rows = []
    for kind in ("kvpop", "dense"):       # dense last: its 131k cache is the largest allocation
        for L in lengths:
            try:
                r = time_kvjax_decode(model, kind, L, 1, steps, 2 if not smoke else 1, budget)
                r["ms_per_token"] = r["latency_s"] * 1e3
                r["peak_device_bytes"] = _peak_bytes()
            except Exception as e:  # noqa: BLE001 - OOM at 131k is a result
                msg = str(e)
                r = {"impl": f"kvjax-{kind}", "length": L,
                     "error": "OOM" if "RESOURCE_EXHAUSTED" in msg or "memory" in msg.lower() else msg[:300]}
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "peak_rss_bytes"}), flush=True)
    del model
    jax.clear_caches()
    return {"model": "tiny" if smoke else "qwen3-8b (random bf16 weights)", "budget": budget, "rows": rows}


def section_longgen(smoke: bool) -> dict:
    """The seed's Figure 4: Qwen3-8B shapes (random bf16), and SmolLM2-135M's real weights when
    ``make real-model``'s folder is on the machine (a device has no network to fetch it)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import kvjax
    from kvjax.evaluation.decode_bench import BENCH_MODEL, _kvjax_policy
    from kvjax.evaluation.long_generation import budget, kvjax_policy, rates, time_generation
    from kvjax.real_model import default_model_dir

    length, seg, prompt = (192, 64, list(range(3, 19))) if smoke else (2048, 256, list(range(3, 51)))
    models = [("tiny", kvjax.ModelConfig.from_hf_config({**BENCH_MODEL, "num_hidden_layers": 2, "hidden_size": 128,
                                                          "intermediate_size": 256, "vocab_size": 512}))] if smoke \
        else [("qwen3-8b (random bf16)", kvjax.preset("qwen3-8b").replace(max_position_embeddings=1 << 18))]
    folder = default_model_dir()
    if not smoke and (Path(folder) / "config.json").exists():
        models.append(("smollm2-135m (real weights)", str(folder)))
    rows = []
    for name, src in models:
        model = kvjax.load_hf(src) if (real := isinstance(src, str)) else kvjax.Decoder(
            src, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
        keep = budget(len(prompt), length, 0.75)
        for impl in ("kvjax-dense", "kvjax-kvpop", "kvjax-streaming_llm"):
            for batch in (1, 8):
                row = {"model": name, "impl": impl, "batch": batch, "length": length, "keep": keep}
                try:
                    policy = kvjax_policy(impl, keep) if real else _kvjax_policy(impl[6:], model.config, keep)
                    r = time_generation(model, policy, prompt, batch, length, seg)
                    row.update(rates({"batch": batch, "steps": r["steps"], "times_s": r["times_s"]}),
                               compile_s=r["compile_s"], kv_bytes=r["cache_bytes"], peak_device_bytes=_peak_bytes())
                except Exception as e:  # noqa: BLE001 - an OOM is a result
                    row["error"] = "OOM" if "RESOURCE_EXHAUSTED" in str(e) else f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
        del model
        jax.clear_caches()
    return {"generated": length, "compression": 0.75, "rows": rows, "smollm2": "measured" if len(models) > 1
            else "skipped (smoke)" if smoke else f"skipped: no {folder} on this machine"}


def section_distill(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.configio import from_dict
    from kvjax.train.config import TrainConfig
    from kvjax.train.optim import make_optimizer, trainable_mask
    from kvjax.train.steps import make_train_step
    from kvjax.train.tasks import make_task

    backend, interpret = _kernel_backend(smoke)
    seq = 256 if smoke else 4096
    model = ({"config": {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                         "max_position_embeddings": 4096}} if smoke else
             {"preset": "qwen3-0.6b", "param_dtype": "bfloat16", "compute_dtype": "bfloat16"})
    rows = []
    for kernel in (backend, "xla"):
        d = {"mode": "distill_kvpop", "steps": 2, "model": model,
             "data": {"source": "tokens", "path": "unused.jsonl", "seq_len": seq, "batch_size": 1},
             "eviction": {"sinks": 4, "window": seq // 16, "topk": seq // 4, "kvpop": {"scorer": "mlstm"},
                          "kernel": kernel, "kernel_interpret": interpret and kernel != "xla"}}
        try:
            cfg = from_dict(TrainConfig, d)
            task = make_task(cfg)
            optimizer, _ = make_optimizer(cfg.optim, task.params, 2, [2])
            opt_state = optimizer.init(task.params)
            step = jax.jit(make_train_step(task.loss_fn, optimizer, 1), donate_argnums=(0, 2))
            vocab = task.model().config.vocab_size
            batch = {"tokens": jnp.asarray(np.random.RandomState(0).randint(3, vocab, (1, seq)), jnp.int32),
                     "loss_mask": jnp.ones((1, seq), bool)}
            mask = trainable_mask(task.params, [])
            params = task.params
            times = []
            for i in range(3):
                t = time.perf_counter()
                params, opt_state, m = step(params, task.frozen, opt_state, batch, jax.random.key(i), mask,
                                            jnp.float32(1.0), jnp.int32(i))
                jax.block_until_ready(m["loss"])
                times.append(time.perf_counter() - t)
            rows.append({"kernel": kernel, "interpret": interpret and kernel != "xla", "compile_and_first_s": times[0],
                         "step_s": float(np.median(times[1:])), "loss": float(m["loss"]),
                         "peak_device_bytes": _peak_bytes()})
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            rows.append({"kernel": kernel, "error": "OOM" if "RESOURCE_EXHAUSTED" in msg else
                         f"{type(e).__name__}: {msg[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    return {"seq_len": seq, "model": "tiny" if smoke else "qwen3-0.6b shapes (random bf16)", "rows": rows}


RUNNERS = {"env": section_env, "correctness": section_correctness, "kernels": section_kernels,
           "decode": section_decode, "longgen": section_longgen, "distill": section_distill}


# ---- the driver -----------------------------------------------------------------------------
def run_section(name: str, out: Path, smoke: bool) -> None:
    t = time.time()
    try:
        result = {"ok": True, **RUNNERS[name](smoke)}
    except Exception as e:  # noqa: BLE001 - fail soft: the error is the section's result
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.time() - t, 1)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))


def _gib(row: dict) -> str:
    peak = row.get("peak_device_bytes")
    return "" if peak is None else f"{peak / 2**30:.1f}"


def markdown(report: dict) -> str:
    env = report["sections"].get("env", {})
    lines = [f"# kvjax device check ({'smoke' if report['smoke'] else 'full'})", "",
             f"{report['date']}; device {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}, "
             f"memory {env.get('memory_bytes')} bytes", ""]
    for name in SECTIONS:
        sec = report["sections"].get(name, {})
        lines.append(f"## {name}: {'ok' if sec.get('ok') else 'FAILED'} ({sec.get('seconds', '?')} s)")
        if not sec.get("ok"):
            lines.append(f"`{sec.get('error', 'no result')}`")
        elif name == "correctness":
            lines += ["| dtype | check | max abs err | tol | ok |", "|---|---|---|---|---|"]
            lines += [f"| {c['dtype']} | {c['check']} | {c['max_abs_err']:.2e} | {c['tol']:.0e} | {c['ok']} |"
                      for c in sec["checks"]]
        elif name == "kernels":
            import kernel_speed as kbench

            ok = [r for r in sec["rows"] if "error" not in r]
            lines.append(kbench.markdown(ok, env.get("device_kind"), sec["backend"]) if ok else "")
            lines += [f"S = {r['S']}: `{r['error']}`" for r in sec["rows"] if "error" in r]
        elif name == "decode":
            lines += ["| cache | context | ms/token | peak device GiB |", "|---|---|---|---|"]
            lines += [f"| {r['impl']} | {r['length']} | {r.get('ms_per_token', r.get('error'))} | {_gib(r)} |"
                      for r in sec["rows"]]
        elif name == "longgen":
            lines += [f"{sec['generated']} tokens generated at {sec['compression']:.0%} compression; SmolLM2: "
                      f"{sec['smollm2']}", "", "| model | cache | batch | tokens/s | last 512 tokens/s | KV MiB | "
                      "peak device GiB |", "|---|---|---|---|---|---|---|"]
            lines += [f"| {r['model']} | {r['impl']} | {r['batch']} | " + (
                f"{r['tokens_per_s']:.1f} | {r['last_tokens_per_s']:.1f} | {r['kv_bytes'] / 2**20:.0f} | {_gib(r)} |"
                if "error" not in r else f"{r['error']} | | | |") for r in sec["rows"]]
        elif name == "distill":
            lines += ["| kernel | step s | first step s | peak device GiB |", "|---|---|---|---|"]
            lines += [f"| {r['kernel']} | {r.get('step_s', r.get('error'))} | {r.get('compile_and_first_s', '')} | "
                      f"{_gib(r)} |" for r in sec["rows"]]
        else:
            lines.append("\n".join(f"- {k}: {v}" for k, v in sec.items() if k not in ("ok", "seconds")))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/device-check")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device (CPU: interpret mode)")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)   # the child process's job
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        run_section(args.section, out, args.smoke)
        return 0
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "smoke": args.smoke, "sections": {}}
    for name in args.sections:
        box = SMOKE_TIME_BOX if args.smoke else TIME_BOX[name]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--out", str(out)] + \
              (["--smoke"] if args.smoke else [])
        t = time.time()
        print(f"device_check: {name} (time box {box} s)", flush=True)
        (out / f"{name}.json").unlink(missing_ok=True)
        try:
            proc = subprocess.run(cmd, timeout=box, capture_output=True, text=True)
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            log = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            report["sections"][name] = {"ok": False, "error": f"timed out after {box} s", "seconds": box}
        (out / f"{name}.log").write_text(log)
        if name not in report["sections"]:
            f = out / f"{name}.json"
            report["sections"][name] = json.loads(f.read_text()) if f.exists() else {
                "ok": False, "error": f"no result (exit {proc.returncode}); see {name}.log", "seconds":
                round(time.time() - t, 1)}
        print(f"device_check: {name}: {'ok' if report['sections'][name]['ok'] else 'FAILED'} "
              f"({time.time() - t:.0f} s)", flush=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "device_check.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
