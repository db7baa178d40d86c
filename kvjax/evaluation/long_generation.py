"""Long generation on the real model, the seed's Figure 4: latency and peak memory of generating
2k-8k tokens from a short prompt, kvjax's dense and bounded caches beside ``transformers`` and
kvpress's decoding-time compression, measured side by side.

    python -m kvjax.evaluation.long_generation --lengths 2048 4096 8192 --batches 1 8
    make long-generation          # the same, into results/long-generation

Each (implementation, batch, length) runs in a fresh process, so its peak resident memory
(``VmHWM``) is its own; the records go to ``records.jsonl.gz`` as each run ends, so a stopped
sweep resumes with the runs it lacks. Every run feeds the same chat prompt to ``batch`` rows and
generates ``length`` tokens greedily, EOS off, fp32.

- **kvjax** drives the decode engine (:mod:`kvjax.decode`, what ``generate`` runs): one jitted
  prefill, then jitted segments of ``segment`` decode steps, timed one by one, so the same run
  gives the whole generation's rate and its last 512 tokens'. Compilation is timed apart
  (ahead of time). The tokens equal ``kvjax.generate``'s (tested).
- **transformers** and **kvpress** run ``model.generate`` (``experiments/hf_long_generation.py``),
  timed at every step: ``transformers`` in this Python, kvpress in its own venv.

A bounded run at compression ``c`` keeps ``round((1 - c) (prompt + length))`` entries per KV
head: kvjax's slot buffer holds exactly that many (4 sinks, the scorer's 32-token window, the rest
long-range); kvpress's ``DecodingPress`` compresses back to it every ``interval`` steps, so its
cache holds up to ``interval`` more. The KV bytes reported are what each cache holds at its
largest.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvjax.evaluation.decode_bench import peak_rss_bytes
from kvjax.evaluation.jsonl_gz import compact, read_jsonl

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
ROOT = Path(__file__).resolve().parents[2]
LEARNED_SCORERS = ROOT / "assets/smollm2-scorers/kvpop-mlp-mean"     # the static-priority learned policy
KVJAX_IMPLS = ("kvjax-dense", "kvjax-kvpop", "kvjax-streaming_llm")
HF_IMPLS = ("transformers-dense", "kvpress-streaming_llm", "kvpress-knorm")
IMPLS = KVJAX_IMPLS + HF_IMPLS
DENSE = ("kvjax-dense", "transformers-dense")
SINKS, WINDOW = 4, 32
LAST = 512                      # "the last 512 tokens"
HF_SCRIPT = ROOT / "experiments" / "hf_long_generation.py"


def budget(prompt_len: int, length: int, compression: float) -> int:
    """Entries per KV head a bounded run keeps: ``round((1 - compression) (prompt + length))``."""
    keep = round((1 - compression) * (prompt_len + length))
    if keep < SINKS + WINDOW + 1:
        raise ValueError(f"compression {compression} of {prompt_len + length} tokens keeps {keep} entries per head, "
                         f"fewer than the {SINKS} sinks + {WINDOW} window + 1 a bounded cache needs")
    return keep


def kvjax_policy(impl: str, keep: int, scorers: str | Path = LEARNED_SCORERS):
    """The cache of a kvjax run: dense, the shipped learned (KVpop MLP) scorers or StreamingLLM at
    ``keep`` entries per KV head."""
    from kvjax.cache.dense import DenseKV
    from kvjax.eviction.config import EvictionConfig
    from kvjax.eviction.policies import make_policy
    from kvjax.export import load_scorers

    if impl == "kvjax-dense":
        return DenseKV()
    ev = EvictionConfig(sinks=SINKS, window=WINDOW, topk=keep - SINKS - WINDOW)
    if impl == "kvjax-kvpop":
        return load_scorers(scorers, config=ev)
    if impl == "kvjax-streaming_llm":
        return make_policy("streaming_llm", ev)
    raise ValueError(f"unknown kvjax implementation {impl!r}; expected one of {KVJAX_IMPLS}")


def time_generation(model, policy, prompt_ids: list[int], batch: int, length: int, segment: int = 256) -> dict:
    """Generate ``length`` tokens for ``batch`` copies of ``prompt_ids`` through ``policy``'s
    cache, greedily, in jitted segments of ``segment`` steps (the first one shorter when
    ``length`` is not a multiple of it, so the last tokens are timed in whole segments).

    Returns ``steps`` (tokens generated at the end of the prefill and of every segment),
    ``times_s`` (seconds from the start to each of those ends, compilation excluded),
    ``compile_s``, ``cache_bytes`` (the cache pytree), ``tokens`` (``int32 [batch, length]``,
    the generated ids)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kvjax import decode

    if length < 1 or segment < 1:
        raise ValueError(f"length {length} and segment {segment} must be positive")
    S = len(prompt_ids)
    need = S + length
    if need > model.config.max_position_embeddings:
        raise ValueError(f"prompt {S} + length {length} = {need} exceeds the model's max_position_embeddings="
                         f"{model.config.max_position_embeddings}")
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray([prompt_ids] * batch, jnp.int32)
    lengths = jnp.full((batch,), S, jnp.int32)

    def prefill(params, pparams, tokens):
        m = nnx.merge(graphdef, params)
        state = decode.open_state(m, policy, pparams, batch, need, lengths)
        hidden, state = decode.feed_prompt(m, decode.bind(policy, pparams), state, tokens, lengths)
        return state.replace(token=jnp.argmax(decode.last_logits(m, hidden, lengths), -1).astype(jnp.int32))

    def run_segment(params, pparams, state, *, steps: int):
        m = nnx.merge(graphdef, params)
        attend = decode.bind(policy, pparams)

        def step(st, _):
            logits, nxt = decode.decode_step(m, attend, st)
            return nxt.replace(token=jnp.argmax(logits, -1).astype(jnp.int32)), st.token

        state, out = jax.lax.scan(step, state, None, length=steps)
        return state, out.T

    t = time.perf_counter()
    prefill_c = jax.jit(prefill).lower(params, policy.params, tokens).compile()
    state_shape = jax.eval_shape(prefill, params, policy.params, tokens)
    plan = ([length % segment] if length % segment else []) + [segment] * (length // segment)
    compiled = {n: jax.jit(functools.partial(run_segment, steps=n), donate_argnums=(2,))
                .lower(params, policy.params, state_shape).compile() for n in set(plan)}
    compile_s = time.perf_counter() - t
    start = time.perf_counter()
    state = jax.block_until_ready(prefill_c(params, policy.params, tokens))
    times, out = [time.perf_counter() - start], []
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.cache))
    for n in plan:
        state, new = compiled[n](params, policy.params, state)
        out.append(np.asarray(new))         # waits for the segment
        times.append(time.perf_counter() - start)
    return {"steps": np.cumsum([0] + plan).tolist(), "times_s": times, "compile_s": compile_s,
            "cache_bytes": int(cache_bytes), "tokens": np.concatenate(out, axis=1)}


def run_kvjax(spec: dict) -> dict:
    """One kvjax run in this process (``spec`` as :func:`specs` writes it)."""
    import kvjax

    model = kvjax.load_hf(spec["model"])
    keep = None if spec["impl"] == "kvjax-dense" else budget(len(spec["prompt_ids"]), spec["length"],
                                                              spec["compression"])
    policy = kvjax_policy(spec["impl"], keep)
    r = time_generation(model, policy, spec["prompt_ids"], spec["batch"], spec["length"], spec["segment"])
    return {**_key(spec), "keep": keep, "steps": r["steps"], "times_s": r["times_s"], "compile_s": r["compile_s"],
            "kv_bytes": r["cache_bytes"], "peak_rss_bytes": peak_rss_bytes(),
            "head_tokens": r["tokens"][0, :32].tolist()}


def _key(spec: dict) -> dict:
    return {k: spec[k] for k in ("impl", "batch", "length", "compression")}


def specs(impls, batches, lengths, compressions, model: str, prompt_ids: list[int], segment: int,
          interval: int) -> list[dict]:
    """Every run of a sweep: dense implementations once per (batch, length), bounded ones per
    compression too; cheapest first (so a stopped sweep has the short runs)."""
    out = []
    for length in sorted(lengths):
        for batch in sorted(batches):
            for impl in impls:
                for c in ([None] if impl in DENSE else compressions):
                    if c is not None:
                        budget(len(prompt_ids), length, c)      # refused before any run starts
                    out.append({"impl": impl, "batch": batch, "length": length, "compression": c, "model": model,
                                "prompt_ids": prompt_ids, "segment": segment, "interval": interval})
    return out


def resolve_lengths(lengths: list[str], prompt_len: int, positions: int) -> list[int]:
    """Generated lengths as integers, ``"max"`` being ``positions - prompt_len``; a length that
    would run past the model's positions is refused before any run starts."""
    out = []
    for x in lengths:
        n = positions - prompt_len if x == "max" else int(x)
        if prompt_len + n > positions:
            raise SystemExit(f"--lengths {x}: prompt {prompt_len} + {n} generated tokens exceeds the model's "
                             f"max_position_embeddings={positions}; use 'max' ({positions - prompt_len}) or less")
        out.append(n)
    return out


def prompt_ids(model_dir: str) -> list[int]:
    """:data:`PROMPT` as one chat turn, through the model folder's own tokenizer."""
    import transformers

    from kvjax.text import encode_prompts

    if not (Path(model_dir) / "tokenizer_config.json").exists():
        raise SystemExit(f"--model {model_dir}: no tokenizer_config.json there; the prompt needs the model's tokenizer")
    return encode_prompts(transformers.AutoTokenizer.from_pretrained(model_dir), [PROMPT])[0]


def run_isolated(spec: dict, hf_python: str, timeout: int) -> dict:
    """One run in a fresh process (kvjax's in this Python, the HF ones in ``hf_python``); a crash or
    an out-of-memory kill is recorded as an error, not raised."""
    if spec["impl"] in KVJAX_IMPLS:
        cmd = [sys.executable, "-m", "kvjax.evaluation.long_generation", "--one", json.dumps(spec)]
    else:       # transformers in this Python (kvjax's test extra), kvpress in its own venv
        python = sys.executable if spec["impl"] == "transformers-dense" else hf_python
        cmd = [python, str(HF_SCRIPT), json.dumps(spec)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**_key(spec), "error": f"timed out after {timeout} s"}
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        return {**_key(spec), "error": tail}
    return json.loads(res.stdout.strip().splitlines()[-1])


def rates(rec: dict) -> dict:
    """Tokens/s over the whole generation (prefill included) and in its last 512 tokens, all rows."""
    steps, times, B = rec["steps"], rec["times_s"], rec["batch"]
    end = times[-1]
    i = min(range(len(steps)), key=lambda j: abs(steps[j] - (steps[-1] - LAST)))
    return {"tokens_per_s": B * steps[-1] / end, "last_tokens_per_s": B * (steps[-1] - steps[i]) / (end - times[i]),
            "latency_s": end}


def _label(r: dict) -> str:
    return r["impl"] if r["compression"] is None else f"{r['impl']} {r['compression']:.0%}"


def markdown(records: list[dict]) -> str:
    out = ["| implementation | batch | generated | tokens/s, whole | tokens/s, last 512 | seconds | peak RSS MiB | "
           "KV MiB held | compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["batch"], r["length"], IMPLS.index(r["impl"]), r["compression"] or 0)):
        if "error" in r:
            out.append(f"| {_label(r)} | {r['batch']} | {r['length']} | failed: {r['error']} | | | | | |")
            continue
        x = rates(r)
        out.append(f"| {_label(r)} | {r['batch']} | {r['length']} | {x['tokens_per_s']:.1f} | "
                   f"{x['last_tokens_per_s']:.1f} | {x['latency_s']:.0f} | {r['peak_rss_bytes'] / 2**20:.0f} | "
                   f"{r['kv_bytes'] / 2**20:.1f} | {r['compile_s']:.1f} |")
    return "\n".join(out) + "\n"


def ratios(records: list[dict]) -> list[dict]:
    """The issue's side-by-side ratios per (batch, length): bounded kvjax vs dense kvjax (last 512
    tokens, KV bytes), dense kvjax vs ``transformers`` (whole generation), bounded kvjax vs kvpress
    at the same budget (whole generation, peak memory)."""
    by = {(r["impl"], r["batch"], r["length"], r["compression"]): r for r in records if "error" not in r}
    out = []
    for batch, length in sorted({(b, n) for _, b, n, _ in by}):
        dense = by.get(("kvjax-dense", batch, length, None))
        hf = by.get(("transformers-dense", batch, length, None))
        row = {"batch": batch, "length": length}
        if dense and hf:
            row["dense_vs_transformers"] = rates(dense)["tokens_per_s"] / rates(hf)["tokens_per_s"]
        for (impl, b, n, c), r in sorted(by.items(), key=lambda kv: str(kv[0])):
            if (b, n) != (batch, length) or c is None or not impl.startswith("kvjax"):
                continue
            name = f"{impl.split('-', 1)[1]}_{round(c * 100)}"
            if dense:
                row[f"{name}_vs_dense_last512"] = rates(r)["last_tokens_per_s"] / rates(dense)["last_tokens_per_s"]
                row[f"{name}_kv_share_of_dense"] = r["kv_bytes"] / dense["kv_bytes"]
            for press in ("kvpress-streaming_llm", "kvpress-knorm"):
                p = by.get((press, batch, length, c))
                if p:
                    row[f"{name}_vs_{press}"] = rates(r)["tokens_per_s"] / rates(p)["tokens_per_s"]
                    row[f"{name}_rss_vs_{press}"] = r["peak_rss_bytes"] / p["peak_rss_bytes"]
        out.append(row)
    return out


def plot(records: list[dict], path: Path) -> None:
    """Figure 4: end-to-end latency and peak memory against generated length, per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    batches = sorted({r["batch"] for r in ok})
    if not batches:
        return
    fig, axes = plt.subplots(len(batches), 2, figsize=(11, 4 * len(batches)), squeeze=False)
    for row, batch in zip(axes, batches):
        for label in sorted({_label(r) for r in ok if r["batch"] == batch}):
            pts = sorted((r["length"], r) for r in ok if r["batch"] == batch and _label(r) == label)
            xs = [p[0] for p in pts]
            style = "--" if label.startswith(("transformers", "kvpress")) else "-"
            row[0].plot(xs, [rates(p[1])["latency_s"] for p in pts], style, marker="o", label=label)
            row[1].plot(xs, [p[1]["peak_rss_bytes"] / 2**30 for p in pts], style, marker="o", label=label)
        for ax, title, unit in ((row[0], "end-to-end latency", "seconds"), (row[1], "peak resident memory", "GiB")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("generated tokens")
            ax.set_ylabel(unit)
            ax.set_title(f"{title}, batch {batch}")
            ax.grid(True, alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(records: list[dict], out: Path, meta: dict) -> None:
    (out / "table.md").write_text(markdown(records))
    (out / "summary.json").write_text(json.dumps({**meta, "ratios": ratios(records)}, indent=2) + "\n")
    plot(records, out / "long_generation.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)          # a kvjax run's spec, in the child process
    ap.add_argument("--lengths", nargs="+", default=["2048", "4096", "max"],
                    help="tokens to generate; 'max' fills the model's positions (8192 - prompt on SmolLM2)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--compressions", type=float, nargs="+", default=[0.75, 0.88])
    ap.add_argument("--impls", nargs="+", default=[i for i in IMPLS if i != "kvpress-knorm"], choices=IMPLS,
                    help="default: all but kvpress-knorm (kvpress's StreamingLLM is the like-for-like press)")
    ap.add_argument("--segment", type=int, default=256, help="decode steps per timed kvjax segment")
    ap.add_argument("--interval", type=int, default=64, help="kvpress DecodingPress: steps between compressions")
    ap.add_argument("--model", help="an HF folder (default: SmolLM2-135M-Instruct, made by `make real-model`)")
    ap.add_argument("--hf-python", default=".venv-kvpress/bin/python",
                    help="the Python with transformers + kvpress (`bash experiments/kvpress_venv.sh` makes it)")
    ap.add_argument("--timeout", type=int, default=4 * 3600, help="seconds one run may take")
    ap.add_argument("--out", default="runs/long-generation")
    ap.add_argument("--report", action="store_true", help="rewrite the table and plot from the stored records")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_kvjax(json.loads(args.one))))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "records.jsonl.gz"
    records = read_jsonl(store)
    meta = {"prompt": PROMPT, "learned_scorers": str(LEARNED_SCORERS.relative_to(ROOT)), "segment": args.segment,
            "kvpress_interval": args.interval, "cores": os.cpu_count()}
    if not args.report:
        needs_kvpress = [i for i in args.impls if i.startswith("kvpress-")]   # transformers-dense runs here
        if needs_kvpress and not Path(args.hf_python).exists():
            raise SystemExit(f"--hf-python {args.hf_python}: not found; make kvpress's venv with "
                             f"`bash experiments/kvpress_venv.sh`, or leave out {needs_kvpress} with --impls")
        from kvjax.convert.hf_io import read_config
        from kvjax.real_model import ensure_model

        model = args.model or str(ensure_model())
        ids = prompt_ids(model)
        lengths = resolve_lengths(args.lengths, len(ids), read_config(model).max_position_embeddings)
        done = {json.dumps(_key(r), sort_keys=True) for r in records if "error" not in r}
        todo = [s for s in specs(args.impls, args.batches, lengths, args.compressions, model, ids,
                                 args.segment, args.interval) if json.dumps(_key(s), sort_keys=True) not in done]
        print(f"{len(todo)} runs to go ({len(done)} stored in {store}); load average {os.getloadavg()[0]:.2f}",
              flush=True)
        for n, spec in enumerate(todo, 1):
            t = time.perf_counter()
            rec = {**run_isolated(spec, args.hf_python, args.timeout), "load_average": os.getloadavg()[0],
                   "prompt_len": len(ids)}
            records = [r for r in records if _key(r) != _key(rec)] + [rec]
            compact(store, [json.dumps(r) for r in records])
            say = rec.get("error") or ", ".join(f"{k} {v:.1f}" for k, v in rates(rec).items())
            print(f"[{n}/{len(todo)}] {_label(rec)} batch {spec['batch']} length {spec['length']}: {say} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
    write_report(records, out, meta)
    print(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
