"""kvpress side of the kvjax-vs-kvpress comparison (runs inside .venv-kvpress; never imports kvjax/jax).

    bash experiments/kvpress_venv.sh
    .venv-kvpress/bin/python experiments/kvpress_compare.py --problems P.jsonl \\
        --model ~/.cache/kvjax/models/smollm2-135m-instruct --presses none snapkv streaming_llm \\
        --compressions 0.75 0.88 --max-new 32 --out runs/kvpress-compare

Input: one JSON object a line, ``{"id", "task", "length", "context_ids", "question_ids", "answers",
"metric": "all"|"any"}``, already tokenized (context = chat-template head + context text; question =
the rest of the prompt, up to and including the assistant header and any answer prefix).

Protocol (kvpress's "question-agnostic" setting, as in ``kvpress/pipeline.py``
``KVPressTextGenerationPipeline._forward`` / ``generate_answer``):

1. ``with press(model): model.model(input_ids=context_ids, past_key_values=DynamicCache())`` - the
   press's forward hooks compress every layer's cache once, at the end of that layer's prefill, to
   ``int(len(context) * (1 - compression))`` entries (``kvpress.utils.compute_n_kept``). Only the
   context is seen: the question is not part of the scored prompt.
2. Outside the press: the question ids are fed with ``position_ids`` continuing from the
   *uncompressed* context length (as the pipeline does), ``logits_to_keep=1``; then greedy decoding,
   one token at a time, up to ``--max-new`` tokens in all, no further compression; stop at the
   generation config's / tokenizer's EOS or ``<|im_end|>`` (the stop token is not part of the output).
3. Score (RULER string match): ``all`` = fraction of answers (lowercased) contained in the lowercased
   output; ``any`` = 1 if any is.

``none`` runs once per problem, recorded with compression 0.0 (the dense baseline column). The presses,
by name, with their knobs (``--window W --kernel K --sinks S``): ``experiments/kvpress_presses.py``.

Three departures from a plain prefill, each following kvpress's own code: after key re-rotation
(finch, keyrerotation_streaming_llm) the question starts at the compressed cache length
(``pipeline.py``); kvcompose_unstructured's replayed copy of the context is cut from the cache (kvpress
0.5.5 leaves it there; the structured variant cuts it); when layers keep different lengths (kvcompose)
the question is fed one token at a time (transformers' sdpa mask is sized from layer 0).

How kvpress 0.5.5 picks the kept set (read from its source; matters when comparing with kvjax):

* Everything is per layer and per KV head (GQA: 3 KV heads x 3 query heads on SmolLM2-135M), once,
  at the end of prefill, over the context only; ``ScorerPress.compress`` keeps the top-``n_kept``
  scores by ``topk`` and gathers them, so the kept entries are re-ordered by score (harmless: RoPE is
  already applied to the cached keys and the decode mask is all-ones over the cache).
* snapkv: observation window = the last W *context* tokens. Their (post-RoPE) queries attend to all
  context keys; the softmax runs over the whole causal row (window included), then the window's
  columns are dropped without renormalising; mean over the W queries, ``avg_pool1d`` (kernel K,
  stride 1, zero padding K//2, so edges are damped), then mean over the query heads of each KV group
  (mean, not max). The window itself is always kept (padded with max+1) and counts toward
  ``n_kept``: with a short context and a high ratio the window eats nearly all of the budget.
* pyramidkv: SnapKV scores with a per-layer budget (more in low layers, ``beta`` steepness,
  KVCache-Factory formula); falls back to SnapKV's flat budget when the pyramid does not fit
  (short contexts).
* adakv_snapkv: SnapKV scores, then a layer-wide top-k across KV heads (each head keeps at least
  20% of ``n_kept``). The cache is NOT shrunk: evicted entries are masked during decoding with a
  fake key whose attention underflows to 0 (``kvpress/attention_patch.py``); needs a non-eager
  attention implementation (we use sdpa). ``kv_kept_frac`` below is computed from that mask.
* tova: attention of the last context token only, averaged over ALL query heads (one set for every
  KV head, i.e. no per-head choice); the last token is always kept.
* streaming_llm: positional: the first S context tokens plus the most recent ones; no re-rotation
  (kvpress notes KeyRerotationPress is needed to match the paper).
* expected_attention: mean and covariance of the context's pre-RoPE queries (first S excluded),
  RoPE averaged over the next 512 positions, expected softmax weight times the value norm; mean over
  the query heads of a group; the first S tokens are always kept.
* knorm keeps the keys with the smallest L2 norm; keydiff the keys least cosine-similar to the mean
  (normalised) key of that head.

Output: ``OUT/records.jsonl.gz``, one record per (problem, press, compression), appended (a gzip member each) and flushed
one at a time; a rerun skips the records already there (resumable; the settings must match). At
the end a markdown table (rows press, columns compression, mean score +- standard error, N) is
printed; ``OUT/table.md`` gets the same table over every record in the store.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
_spec = importlib.util.spec_from_file_location("jsonl_gz", Path(__file__).parents[1] / "kvjax/evaluation/jsonl_gz.py")
_spec.loader.exec_module(_gz := importlib.util.module_from_spec(_spec))   # the stores' format; imports no kvjax
compact_store, gzip_member, stored_lines = _gz.compact, _gz.gzip_member, _gz.stored_lines
from kvpress_presses import PRESSES, SINKED, WINDOWED, drop_kvcompose_replay, make_press, question_start  # noqa: E402

# the model hub is not reachable here, and nothing may be downloaded: local folders only
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SETTINGS = ("model", "max_new", "window", "kernel", "sinks")


def die(msg: str) -> None:
    print(f"kvpress_compare: error: {msg}", file=sys.stderr)
    sys.exit(2)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- pure helpers (no torch) -----------------------------------------------------------------

def score(output: str, answers: list[str], metric: str) -> float:
    """RULER string match."""
    out = output.lower()
    hits = [a.lower() in out for a in answers]
    if metric == "all":
        return sum(hits) / len(hits)
    if metric == "any":
        return float(any(hits))
    raise ValueError(f"unknown metric {metric!r}")


def load_problems(path: Path, limit: int | None) -> list[dict]:
    if not path.is_file():
        die(f"--problems {path}: no such file")
    problems, seen = [], set()
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                p = json.loads(line)
            except json.JSONDecodeError as e:
                die(f"{path}:{n}: not JSON ({e})")
            missing = [k for k in ("id", "context_ids", "question_ids", "answers", "metric") if k not in p]
            if missing:
                die(f"{path}:{n}: missing field(s) {missing}")
            if p["metric"] not in ("all", "any"):
                die(f"{path}:{n}: metric must be 'all' or 'any', got {p['metric']!r}")
            if not p["context_ids"] or not p["question_ids"] or not p["answers"]:
                die(f"{path}:{n}: context_ids, question_ids and answers must be non-empty")
            p["id"] = str(p["id"])
            if p["id"] in seen:
                die(f"{path}:{n}: duplicate id {p['id']!r}")
            seen.add(p["id"])
            p.setdefault("task", "")
            p.setdefault("length", len(p["context_ids"]) + len(p["question_ids"]))
            problems.append(p)
            if limit is not None and len(problems) >= limit:
                break
    if not problems:
        die(f"{path}: no problems")
    return problems


def key(problem_id: str, press: str, compression: float) -> tuple[str, str, float]:
    return (problem_id, press, round(float(compression), 6))


def load_records(path: Path, settings: dict) -> dict:
    """Records already in ``path`` (``records.jsonl.gz``; a legacy ``records.jsonl`` beside it is
    converted) by key, the store compacted into one gzip member; a torn tail is dropped."""
    legacy = path.with_name("records.jsonl")
    source = legacy if legacy.exists() and not path.exists() else path
    done = {}
    for n, line in enumerate(stored_lines(source, log), 1):
        r = json.loads(line)
        clash = {k: (r.get(k), settings[k]) for k in SETTINGS if r.get(k) != settings[k]}
        if clash:
            die(f"{source}:{n} was written with other settings {clash} (record, now); use another --out")
        done[key(r["id"], r["press"], r["compression"])] = r
    if source.exists():
        compact_store(path, map(json.dumps, done.values()))
        if source != path:
            source.unlink()
    return done


def table(records: list[dict], presses: list[str], compressions: list[float]) -> str:
    cols = sorted({round(c, 6) for c in compressions} | ({0.0} if "none" in presses else set()))
    head = "| press | " + " | ".join("0 (dense)" if c == 0 else f"{c:g}" for c in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    for press in presses:
        cells = []
        for c in cols:
            s = [r["score"] for r in records if r["press"] == press and round(r["compression"], 6) == c]
            if not s:
                cells.append("-")
                continue
            mean = sum(s) / len(s)
            se = math.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - 1) / len(s)) if len(s) > 1 else 0.0
            cells.append(f"{mean:.3f} ± {se:.3f} (N={len(s)})")
        lines.append(f"| {press} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- model side --------------------------------------------------------------------------------

def check_rope(model, model_dir: Path) -> None:
    """transformers 4.x reads a transformers-5 config's ``rope_parameters`` as an unknown key and
    falls back to rope_theta=10000: a silently different model. Refuse that."""
    raw = json.loads((model_dir / "config.json").read_text())
    want = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    cfg = model.config
    got = getattr(cfg, "rope_theta", None)
    if got is None:
        got = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    if want is not None and (got is None or abs(float(got) - float(want)) > 1e-6 * float(want)):
        die(f"the loaded config has rope_theta={got}, {model_dir}/config.json says {want}: this transformers "
            f"version does not read the folder's config (use experiments/kvpress_venv.sh's transformers 5.2)")


class Runner:
    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from transformers.utils import logging as hf_logging

        import kvpress  # noqa: F401  (patches the attention functions, needed by AdaKV)

        hf_logging.disable_progress_bar()   # the per-tensor "Loading weights" bar floods logs

        if threads > 0:
            torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # float32 on CPU; sdpa (AdaKV refuses eager; with sdpa the presses compute their own window
        # attention, since the layer returns no weights)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
        check_rope(self.model, model_dir)
        stop = self.model.generation_config.eos_token_id
        stop = set(stop if isinstance(stop, list) else [stop] if stop is not None else [])
        if self.tok.eos_token_id is not None:
            stop.add(self.tok.eos_token_id)
        im_end = self.tok.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tok.unk_token_id:
            stop.add(im_end)
        self.stop = stop

    def run(self, problem: dict, press, max_new: int) -> dict:
        """One problem under one press, following kvpress/pipeline.py (_forward, generate_answer)."""
        from transformers import DynamicCache

        torch, model = self.torch, self.model
        ctx = torch.tensor([problem["context_ids"]], dtype=torch.long)
        q = torch.tensor([problem["question_ids"]], dtype=torch.long)
        n_ctx = ctx.shape[1]
        t0 = time.perf_counter()
        torch.manual_seed(0)     # presses that draw random numbers (random, leverage, compactor) repeat exactly
        # Head-wise presses leave their eviction mask on the attention modules; kvpress's attention patch clears
        # it at the next sdpa prefill, but eager passes (observed_attention, kvcompose) are not patched, so a
        # mask from the previous record would survive into this one. Clear it here.
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
        with torch.inference_mode():
            cache = DynamicCache()
            with press(model) if press is not None else contextlib.nullcontext(), self.eager_if_needed(press):
                model.model(input_ids=ctx, past_key_values=cache)      # prefill without the lm head
            drop_kvcompose_replay(press, cache, n_ctx)
            kept = self.kept_fraction(cache, n_ctx)
            start = question_start(press, n_ctx, cache)
            pos = torch.arange(start, start + q.shape[1]).unsqueeze(0)  # the question continues the context
            if len({layer.keys.shape[2] for layer in cache.layers}) == 1:
                out = model(input_ids=q, past_key_values=cache, position_ids=pos, logits_to_keep=1)
            else:
                # Layers keep different numbers of entries (kvcompose; pyramidkv once its pyramid fits): the
                # question's causal mask is sized from layer 0 and transformers' sdpa does not cut it to the
                # other layers' lengths (a shape error), so feed the question one token at a time, which needs
                # no mask and computes the same causal attention.
                for j in range(q.shape[1]):
                    out = model(input_ids=q[:, j:j + 1], past_key_values=cache, position_ids=pos[:, j:j + 1],
                                logits_to_keep=1)
            nxt = pos[:, -1:] + 1
            ids = []
            tok = int(out.logits[0, -1].argmax())
            while True:
                if tok in self.stop:
                    break
                ids.append(tok)
                if len(ids) >= max_new:
                    break
                out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=nxt)
                nxt = nxt + 1
                tok = int(out.logits[0, -1].argmax())
        text = self.tok.decode(ids, skip_special_tokens=True)
        return {"output": text, "new_tokens": len(ids), "kv_kept_frac": kept,
                "seconds": round(time.perf_counter() - t0, 3)}

    @contextlib.contextmanager
    def eager_if_needed(self, press):
        """ObservedAttentionPress reads the prefill's attention weights, which only eager attention returns
        (``kvpress/presses/observed_attention_press.py``): the prefill runs eager, decoding sdpa again (the
        same switch KVComposePress makes for its own passes)."""
        import kvpress as kp

        cfg = self.model.config
        if not isinstance(press, kp.ObservedAttentionPress):
            yield
            return
        before = cfg._attn_implementation
        cfg._attn_implementation = "eager"
        try:
            yield
        finally:
            cfg._attn_implementation = before

    def kept_fraction(self, cache, n_ctx: int) -> float:
        """Mean over layers (and KV heads) of the context entries still attended after prefill."""
        fracs = []
        for i, layer in enumerate(self.model.model.layers):
            n = cache.layers[i].keys.shape[2]
            masked = getattr(layer.self_attn, "masked_key_indices", None)   # AdaKV: masked, not removed
            heads = cache.layers[i].keys.shape[1]
            fracs.append((n - (len(masked[0]) / heads if masked is not None else 0)) / n_ctx)
        return round(sum(fracs) / len(fracs), 4)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=Path, required=True, help="JSONL of tokenized problems")
    ap.add_argument("--model", type=Path, required=True, help="local Hugging Face Llama folder (with tokenizer)")
    ap.add_argument("--presses", nargs="+", default=["none", "snapkv"], choices=PRESSES, metavar="PRESS",
                    help=f"from {', '.join(PRESSES)}")
    ap.add_argument("--compressions", nargs="+", type=float, default=[0.75, 0.88],
                    help="fractions of the context's KV pairs to evict (kvpress compression_ratio)")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--window", type=int, default=32,
                    help="observation window (window_size) of the SnapKV family and FINCH's window")
    ap.add_argument("--kernel", type=int, default=7, help="SnapKV-family pooling kernel (kernel_size)")
    ap.add_argument("--sinks", type=int, default=4,
                    help=f"n_sink (num_sinks) of {', '.join(SINKED)}")
    ap.add_argument("--limit", type=int, default=None, help="only the first N problems (smoke tests)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)

    model_dir = args.model.expanduser()
    if not (model_dir / "config.json").is_file():
        die(f"--model {model_dir}: no config.json there (a local Hugging Face folder is needed; nothing is downloaded)")
    if args.max_new < 1:
        die("--max-new must be >= 1")
    for c in args.compressions:
        if not 0 <= c < 1:
            die(f"--compressions: {c} is not in [0, 1)")
    if args.kernel < 1 or args.kernel % 2 == 0:
        die("--kernel must be odd (avg_pool1d with padding kernel//2 keeps the length only for odd kernels)")
    presses = list(dict.fromkeys(args.presses))
    problems = load_problems(args.problems, args.limit)

    shortest = min(len(p["context_ids"]) for p in problems)
    if any(p in WINDOWED for p in presses) and shortest <= args.window:
        die(f"a context has {shortest} tokens, not more than --window {args.window} (SnapKV needs more)")
    if any(p in SINKED for p in presses) and shortest <= args.sinks:
        die(f"a context has {shortest} tokens, not more than --sinks {args.sinks}")

    # the model by its folder's name, not its path: a store committed on one machine resumes on another
    settings = {"model": model_dir.resolve().name, "max_new": args.max_new, "window": args.window,
                "kernel": args.kernel, "sinks": args.sinks}
    args.out.mkdir(parents=True, exist_ok=True)
    rec_path = args.out / "records.jsonl.gz"
    done = load_records(rec_path, settings)

    jobs = [(p, press, 0.0 if press == "none" else c)   # press by press: a long sweep completes whole rows
            for press in presses for p in problems for c in (args.compressions if press != "none" else [0.0])]
    todo = [j for j in jobs if key(j[0]["id"], j[1], j[2]) not in done]
    log(f"kvpress_compare: {len(jobs)} records wanted, {len(jobs) - len(todo)} already in {rec_path}, "
        f"{len(todo)} to run")

    if todo:
        import importlib.metadata as md

        versions = {p: md.version(p) for p in ("kvpress", "transformers", "torch")}
        runner = Runner(model_dir, args.threads)
        t_all = time.perf_counter()
        with rec_path.open("ab") as f:                     # one gzip member per record
            for n, (p, press_name, c) in enumerate(todo, 1):
                press = make_press(press_name, c, args.window, args.kernel, args.sinks)
                res = runner.run(p, press, args.max_new)
                s = score(res["output"], p["answers"], p["metric"])
                rec = {"id": p["id"], "task": p["task"], "length": p["length"], "press": press_name,
                       "compression": c, "score": s, "metric": p["metric"], "answers": p["answers"],
                       "context_tokens": len(p["context_ids"]), "question_tokens": len(p["question_ids"]),
                       **res, **settings, "versions": versions}
                f.write(gzip_member(json.dumps(rec) + "\n"))
                f.flush()
                os.fsync(f.fileno())
                done[key(p["id"], press_name, c)] = rec
                log(f"[{n}/{len(todo)}] {p['id']} {press_name} {c:g}: score={s:.2f} kept={res['kv_kept_frac']:.3f} "
                    f"{res['seconds']:.1f}s out={res['output'][:60]!r}")
        log(f"kvpress_compare: ran {len(todo)} in {time.perf_counter() - t_all:.1f}s")
        compact_store(rec_path, map(json.dumps, done.values()))

    wanted = {key(j[0]["id"], j[1], j[2]) for j in jobs}
    print(table([r for k, r in done.items() if k in wanted], presses, args.compressions))
    # The stored table covers every record in the store, not only this run's presses, so a run
    # that adds one press does not hide the others.
    stored = list(done.values())
    stored_presses = list(dict.fromkeys(r["press"] for r in stored))
    stored_compressions = sorted({r["compression"] for r in stored if r["press"] != "none"})
    (args.out / "table.md").write_text(table(stored, stored_presses, stored_compressions) + "\n")


if __name__ == "__main__":
    main()
