"""The teacher-feature pass: each trace's per-layer scorer inputs and targets, computed once.

KVpop's scorers read ``x_t = stop_gradient([k_t; v_t])`` (post-RoPE key and value of one
KV head) and regress the frozen model's future attention, so with the backbone frozen
everything a scorer fit needs is a function of the trace alone. One dense forward per
trace writes, for every token ``t``, layer ``l`` and KV head ``h``:

- ``x [T, L, K, 2D]`` bfloat16 (stored as its 16-bit pattern, ``uint16``), memory-mapped;
- ``targets [T, 5, L, K]`` float32 (``TARGETS``): the seed's mean future attention (Eqs.
  15-16, max over the query group, :func:`kvjax.future_attention_target`), the peak single
  read (:func:`kvjax.targets.peak_future_attention`) and their union (the larger of the two
  percentile ranks within the trace, as :mod:`kvjax.evaluation.oracle`), ``-inf`` where
  ``t + w`` is past the trace (no future query); then the two reconstruction targets,
  ``log s_t`` with ``s_t`` KVzip's score of the trace read as a context to repeat
  (``recon``, :func:`kvjax.eviction.kvzip.reconstruction_scores`) and KVzip+'s value-weighted
  score (``recon_plus``: each reading weight times ``||W_O v_t||`` over the reader's
  ``||h_i||``), defined for every token past the sinks (:func:`reconstruction_targets`).

``T`` is the split's total number of tokens; ``index.json`` holds each trace's offset and
length. The pass is resumable: ``progress.json`` (written atomically after the arrays are
flushed) counts the traces done; a rerun continues there. SmolLM2-135M on 2 cores (measured
alone): 223 train traces, 170,717 tokens, in 21 min 22 s (133 tokens/s, compiles included);
23 KB of features per token (3.7 GiB for the train split).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from kvjax.dir_lock import DirLock
from kvjax.evaluation.oracle import _percentile
from kvjax.models.attention import dense_attention
from kvjax.sampling import bucket
from kvjax.targets import future_attention_target, peak_future_attention
from kvjax.train.checkpoint import write_json_atomic

TARGETS = ("mean", "peak", "union", "recon", "recon_plus")
FUTURE_TARGETS = TARGETS[:3]     # from the trace's own dense pass
RECON_TARGETS = TARGETS[3:]      # from a reconstruction pass over the trace


@dataclass(frozen=True)
class FeatureConfig:
    traces_dir: str = "assets/smollm2-traces"   # output of python -m kvjax.traces
    model_dir: str | None = None              # HF folder; default: SmolLM2 via kvjax.real_model
    out_dir: str = "runs/features/smollm2"
    window: int = 32                          # the protected window w of the target (d >= t + w)
    splits: tuple[str, ...] = ("train", "valid")
    max_traces: int = 0                       # per split, the first N traces (0: all)

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        bad = [s for s in self.splits if s not in ("train", "valid", "test")]
        if bad:
            raise ValueError(f"splits: unknown split(s) {bad}; expected train, valid, test")


@functools.partial(jax.jit, static_argnums=(0, 3))
def _trace_features(graphdef, params, tokens_1S, window: int, length):
    """``x [S, L, K, 2D]`` bfloat16, the future targets ``[S, 3, L, K]`` float32 and the dense
    cache ``k, v [L, K, S, D]`` (model dtype) for one trace padded on the right to ``S``
    (``length`` real tokens)."""
    model = nnx.merge(graphdef, params)
    lengths = jnp.reshape(length, (1,))

    def capture(layer, q, k, v, positions, acc):
        out, lse = dense_attention(q, k, v, positions, positions, prefill=True)   # from position 0: query blocks
        mean = future_attention_target(q, k, window=window, lse=lse, lengths_B=lengths)
        peak = peak_future_attention(q, k, window=window, lse=lse, lengths_B=lengths)
        real = jnp.arange(q.shape[1]) < length
        pct = lambda r: _percentile(jnp.where(real, r, -jnp.inf))          # noqa: E731  among real tokens
        union = jnp.where(jnp.isfinite(mean), jnp.maximum(pct(mean), pct(peak)), -jnp.inf)
        x = jnp.concatenate([k, v], axis=-1)[0].astype(jnp.bfloat16)       # [S, K, 2D]
        kv = (jnp.swapaxes(k[0], 0, 1), jnp.swapaxes(v[0], 0, 1))           # [K, S, D]
        return out, acc + ((x, jnp.stack([mean[0], peak[0], union[0]]), kv),)  # targets [3, K, S]

    _, per_layer = model(tokens_1S, None, capture, ())
    x = jnp.stack([p[0] for p in per_layer], axis=1)                        # [S, L, K, 2D]
    tg = jnp.transpose(jnp.stack([p[1] for p in per_layer]), (3, 1, 0, 2))  # [S, 3, L, K]
    k = jnp.stack([p[2][0] for p in per_layer])                              # [L, K, S, D]
    v = jnp.stack([p[2][1] for p in per_layer])
    return x, tg, k, v


def reconstruction_targets(model, k_LKSD, v_LKSD, tokens: list[int], prompts, *, sinks: int) -> np.ndarray:
    """``float32 [n, 2, L, K]``: ``log s_t`` for KVzip's score and KVzip+'s (``RECON_TARGETS``)
    of the ``n = len(tokens)`` trace tokens read as one context to repeat, from the trace's
    dense cache (``[L, K, S, D]``, ``S >= n``, slot = position).

    ``-inf`` (no target) for the first ``sinks`` tokens, which every policy keeps. Tokens that
    KVzip does not reconstruct (the chat template's head past the sinks score 0) take the
    head's smallest positive score in the trace: ranked last, without a ``log 0`` outlier in
    the regression."""
    from kvjax.eviction.kvzip import reconstruction_scores

    n = len(tokens)
    k = tuple(k_LKSD[i][None] for i in range(k_LKSD.shape[0]))
    v = tuple(v_LKSD[i][None] for i in range(v_LKSD.shape[0]))
    out = []
    for plus in (False, True):
        s = np.asarray(reconstruction_scores(model, k, v, [list(tokens)], prompts, plus=plus))[:, 0, :, :n]  # [L, K, n]
        floor = np.min(np.where(s > 0, s, np.inf), axis=-1, keepdims=True)
        floor = np.where(np.isfinite(floor), floor, 1e-30)
        r = np.log(np.maximum(s, floor))
        r[..., :sinks] = -np.inf
        out.append(np.transpose(r, (2, 0, 1)))                                               # [n, L, K]
    return np.stack(out, axis=1).astype(np.float32)


def _fingerprint(model, traces_file: Path, window: int) -> dict:
    from kvjax.export import config_hash

    st = traces_file.stat()
    return {"model_config_sha256": config_hash(model.config), "model_hf_config": model.config.to_hf_config(),
            "traces_file": str(traces_file),
            "traces_bytes": st.st_size, "traces_sha256": hashlib.sha256(traces_file.read_bytes()).hexdigest(),
            "window": window}


def build_split(model, traces_file: Path, out: Path, window: int, max_traces: int = 0, progress: bool = True,
                prompts=None) -> dict:
    """Write (or finish) one split's features under ``out``; returns its index. ``prompts``: the
    reconstruction request (:class:`kvjax.eviction.kvzip.RepeatPrompts`; default: from the
    model's tokenizer)."""
    from tqdm import tqdm

    from kvjax.eviction.kvzip import repeat_prompts_for

    rows = [json.loads(line) for line in traces_file.read_text().splitlines() if line.strip()]
    if max_traces:
        rows = rows[:max_traces]
    if not rows:
        raise ValueError(f"{traces_file}: no traces")
    cfg = model.config
    lengths = np.array([len(r["tokens"]) for r in rows], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    T, L, K, X = int(lengths.sum()), cfg.num_layers, cfg.num_kv_heads, 2 * cfg.head_dim
    index = {**_fingerprint(model, traces_file, window), "ids": [r["id"] for r in rows],
             "offsets": offsets.tolist(), "lengths": lengths.tolist(),
             "prompt_lens": [int(r.get("prompt_len", 0)) for r in rows], "shape_x": [T, L, K, X],
             "shape_targets": [T, len(TARGETS), L, K], "targets": list(TARGETS)}
    out.mkdir(parents=True, exist_ok=True)
    idx_file, prog_file = out / "index.json", out / "progress.json"
    done = 0
    if idx_file.exists():
        old = json.loads(idx_file.read_text())
        diff = sorted(k for k in index if old.get(k) != index[k])
        if diff:
            raise ValueError(f"{out} holds features of other inputs ({', '.join(diff)}); delete it or pick another "
                             "out_dir")
        done = json.loads(prog_file.read_text())["done"] if prog_file.exists() else 0
    mode = "r+" if done else "w+"
    x_mm = np.memmap(out / "x.u16", np.uint16, mode, shape=(T, L, K, X))
    t_mm = np.memmap(out / "targets.f32", np.float32, mode, shape=(T, len(TARGETS), L, K))
    write_json_atomic(idx_file, index)
    prompts = prompts or repeat_prompts_for(model)
    graphdef, params = nnx.split(model)
    bar = tqdm(total=len(rows), initial=done, desc=f"features {out.name}", unit="trace", disable=not progress)
    for i in range(done, len(rows)):
        n = int(lengths[i])
        padded = np.zeros((1, bucket(n, 64)), np.int32)
        padded[0, :n] = rows[i]["tokens"]
        x, tg, k, v = _trace_features(graphdef, params, jnp.asarray(padded), window, jnp.int32(n))
        o = int(offsets[i])
        x_mm[o:o + n] = np.asarray(x[:n]).view(np.uint16)
        t_mm[o:o + n, :len(FUTURE_TARGETS)] = np.asarray(tg[:n])
        t_mm[o:o + n, len(FUTURE_TARGETS):] = reconstruction_targets(model, k, v, rows[i]["tokens"], prompts,
                                                                     sinks=prompts.sinks)
        if i % 8 == 7 or i == len(rows) - 1:
            x_mm.flush()
            t_mm.flush()
            write_json_atomic(prog_file, {"done": i + 1})
        bar.update(1)
    bar.close()
    del x_mm, t_mm
    return index


def build_features(cfg: FeatureConfig, *, model=None, progress: bool = True, prompts=None) -> dict:
    """Run the teacher-feature pass for ``cfg.splits``; returns ``{split: summary}``. ``prompts``:
    the reconstruction request (default: from the model's tokenizer, :func:`build_split`)."""
    import kvjax
    from kvjax.real_model import ensure_model

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = DirLock(out, "teacher-feature pass")
    try:
        model = model or kvjax.load_hf(Path(cfg.model_dir) if cfg.model_dir else ensure_model())
        summary = {}
        for split in cfg.splits:
            f = Path(cfg.traces_dir) / f"{split}.jsonl"
            if not f.exists():
                raise FileNotFoundError(f"{f}: no traces of split {split!r}; run python -m kvjax.traces first")
            t0 = time.time()
            index = build_split(model, f, out / split, cfg.window, cfg.max_traces, progress, prompts)
            summary[split] = {"traces": len(index["ids"]), "tokens": index["shape_x"][0],
                              "seconds": round(time.time() - t0, 1),
                              "x_gib": round(np.prod(index["shape_x"]) * 2 / 2**30, 2)}
        return summary
    finally:
        lock.release()


class FeatureSplit:
    """Read side of one split: ``x(i)`` / ``targets(i)`` of trace ``i`` (memory-mapped)."""

    def __init__(self, folder: str | os.PathLike):
        self.dir = Path(folder)
        idx, prog = self.dir / "index.json", self.dir / "progress.json"
        if not idx.exists():
            raise FileNotFoundError(f"{self.dir}: no feature index; run python -m kvjax.scorer_fit features first")
        self.index = json.loads(idx.read_text())
        done = json.loads(prog.read_text())["done"] if prog.exists() else 0
        if done < len(self.index["ids"]):
            raise ValueError(f"{self.dir}: the feature pass is unfinished ({done} of {len(self.index['ids'])} "
                             "traces); run it again to finish")
        self.x = np.memmap(self.dir / "x.u16", np.uint16, "r", shape=tuple(self.index["shape_x"]))
        self.t = np.memmap(self.dir / "targets.f32", np.float32, "r", shape=tuple(self.index["shape_targets"]))
        self.offsets = np.asarray(self.index["offsets"])
        self.lengths = np.asarray(self.index["lengths"])
        self.window = int(self.index["window"])

    def __len__(self) -> int:
        return len(self.offsets)

    def x_of(self, i: int) -> np.ndarray:
        """``bfloat16 [n, L, K, 2D]``."""
        o, n = self.offsets[i], self.lengths[i]
        return self.x[o:o + n].view(ml_dtypes.bfloat16)

    def targets_of(self, i: int, target: str) -> np.ndarray:
        """``float32 [n, L, K]``."""
        o, n = self.offsets[i], self.lengths[i]
        return self.t[o:o + n, TARGETS.index(target)]
