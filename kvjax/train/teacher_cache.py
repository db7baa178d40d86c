"""The frozen teacher's top-K next-token log-probabilities, computed once (``distill_kvpop``).

A ``distill_kvpop`` step otherwise runs the dense teacher over every batch although its
weights never change. With ``data.teacher_cache: DIR`` the first run writes, for every row of
``data.path`` (truncated to ``data.seq_len``), the teacher's ``data.teacher_topk`` largest
log-probabilities ``log p_T(v | x_<=s)`` and their token ids; every step then reads them with
the row (``kvjax.train.data``) and runs only the student. The KL over that support plus one
bucket for the rest of the vocabulary is ``kvjax.losses.cached_topk_kl``.

Files: ``DIR/meta.json`` (what the cache was made from: the teacher's weights fingerprint, the
token file's hash, ``seq_len``, ``topk``, the row count; ``complete`` once every row is in) and
``DIR/part-NNNNNN.npz`` (rows ``NNNNNN ..``: ``logp [n, S, K] float32``, ``idx [n, S, K] int32``),
each written whole under a temporary name and renamed, so an interrupted pass resumes at the
first missing part. A cache made from other weights, data or settings is refused by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from kvjax.train.checkpoint import write_json_atomic
from kvjax.train.config import TrainConfig

ROWS_PER_PART = 32


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def teacher_section(cfg: TrainConfig):
    """The teacher's model section: ``teacher_hf_path`` if given, else the student's starting model."""
    if cfg.teacher_hf_path is None:
        return cfg.model
    return dataclasses.replace(cfg.model, hf_path=cfg.teacher_hf_path, preset=None, config=None)


def expected_meta(cfg: TrainConfig, rows: int) -> dict:
    """What a cache for ``cfg`` must have been made from."""
    from kvjax.train.checkpoint import weights_fingerprint

    t = teacher_section(cfg)
    if t.hf_path is not None:
        teacher = {"weights": weights_fingerprint(t.hf_path)}
    else:       # a randomly initialised teacher (tests): its shapes and seed
        teacher = {"preset": t.preset, "config": t.config, "seed": cfg.seed, "init_std": t.init_std}
    return {"format_version": 1, "teacher": teacher, "data": _file_hash(Path(cfg.data.path)),
            "seq_len": cfg.data.seq_len, "topk": cfg.data.teacher_topk, "rows": rows,
            "compute_dtype": t.compute_dtype}


def _check_meta(folder: Path, have: dict, want: dict) -> None:
    diff = [k for k in want if have.get(k) != want[k]]
    if diff:
        k = diff[0]
        raise ValueError(f"data.teacher_cache {folder} was made with {k}={have.get(k)!r}, this run needs "
                         f"{want[k]!r}; delete the folder to recompute it or point data.teacher_cache elsewhere")


def ensure_teacher_cache(cfg: TrainConfig, *, quiet: bool = False) -> Path:
    """Compute (or finish) the cache ``cfg.data.teacher_cache`` names; a no-op once complete."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tqdm.auto import tqdm

    from kvjax.train.data import JsonlTokenSource
    from kvjax.train.model_init import build_model

    folder = Path(cfg.data.teacher_cache)
    source = JsonlTokenSource(cfg.data.path, cfg.data.seq_len)
    want = expected_meta(cfg, len(source))
    meta_path = folder / "meta.json"
    if meta_path.exists():
        have = json.loads(meta_path.read_text())
        _check_meta(folder, have, want)
        if have.get("complete"):
            return folder
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(meta_path, {**want, "complete": False})
    starts = [s for s in range(0, len(source), ROWS_PER_PART) if not (folder / f"part-{s:06d}.npz").exists()]
    if starts:
        if jax.process_count() > 1:
            raise RuntimeError(f"data.teacher_cache {folder} is incomplete: compute it in one process first "
                               f"(python -m kvjax.train.teacher_cache --config ...)")
        teacher = build_model(teacher_section(cfg), cfg.seed)
        graphdef, state = nnx.split(teacher)
        k = cfg.data.teacher_topk

        @jax.jit
        def top(state, tokens_BS):
            model = nnx.merge(graphdef, state)
            h, _ = model(tokens_BS)
            logp = jax.nn.log_softmax(model.logits(h).astype(jnp.float32), axis=-1)
            vals, idx = jax.lax.top_k(logp, k)
            return vals, idx.astype(jnp.int32)

        bar = tqdm(total=len(source), initial=len(source) - sum(min(ROWS_PER_PART, len(source) - s) for s in starts),
                   desc="teacher top-k", unit="row", disable=quiet, dynamic_ncols=True)
        for s in starts:
            rows = range(s, min(s + ROWS_PER_PART, len(source)))
            tokens = np.stack([source[i]["tokens"] for i in rows])
            parts = [top(state, jnp.asarray(tokens[j:j + 4])) for j in range(0, len(rows), 4)]
            logp = np.concatenate([np.asarray(v) for v, _ in parts])
            idx = np.concatenate([np.asarray(i) for _, i in parts])
            tmp = folder / f"part-{s:06d}.tmp.npz"
            np.savez(tmp, logp=logp, idx=idx)
            os.replace(tmp, folder / f"part-{s:06d}.npz")
            bar.update(len(rows))
        bar.close()
    write_json_atomic(meta_path, {**want, "complete": True})
    return folder


def load_teacher_cache(cfg: TrainConfig, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(logp [rows, S, K] float32, idx [rows, S, K] int32)`` of a complete cache made for ``cfg``."""
    folder = Path(cfg.data.teacher_cache)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"data.teacher_cache {folder}: no meta.json there (train.py computes it on its "
                                f"first run, or: python -m kvjax.train.teacher_cache --config ...)")
    have = json.loads(meta_path.read_text())
    _check_meta(folder, have, expected_meta(cfg, rows))
    if not have.get("complete"):
        raise ValueError(f"data.teacher_cache {folder} is incomplete (an interrupted pass): run "
                         f"python -m kvjax.train.teacher_cache --config ... to finish it")
    logp, idx = [], []
    for s in range(0, rows, ROWS_PER_PART):
        with np.load(folder / f"part-{s:06d}.npz") as part:
            logp.append(part["logp"])
            idx.append(part["idx"])
    return np.concatenate(logp), np.concatenate(idx)


def main(argv=None) -> int:
    """``python -m kvjax.train.teacher_cache --config X.yaml [--set ...]``: compute the cache alone."""
    from kvjax.configio import cli_config

    cfg, _ = cli_config(TrainConfig, "python -m kvjax.train.teacher_cache", main.__doc__, argv, [],
                        set_example="data.teacher_topk=64", examples=(
                            "python -m kvjax.train.teacher_cache --config configs/smollm2-distill-kvpop.yaml",))
    if cfg.data.teacher_cache is None:
        print("kvjax.train.teacher_cache: error: the config sets no data.teacher_cache folder")
        return 2
    print(ensure_teacher_cache(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
