"""Scorer-only KVpop: fit every layer's and head's scorer to the frozen model's targets.

With the backbone frozen, KVpop's retention loss needs only the scorer inputs and the
targets (:mod:`kvjax.scorer_fit.features`), so a fit never runs the 135M-parameter model:
each step reads ``batch_traces`` traces (their first ``seq_len`` tokens) from the
memory-mapped features and minimises, over all ``L x K`` heads at once,

    mean_l regression_loss(r_hat_l, r_tgt_l)        (centred by default: the keep rule
                                                      ranks within a head, offsets do not matter)

with ``r_hat`` the MLP score of ``[k_t; v_t]`` or the mLSTM's delayed read at ``t + w``.
The target is the seed's mean future attention, the peak single read or their union
(``target``). Adam with warm-up and cosine decay (optax); orbax checkpoints, so a stopped
fit resumes where it was. The result is exported with :func:`kvjax.export_scorers`
(``scorers.safetensors`` + ``scorer_config.json``) and loads with :func:`kvjax.load_scorers`.

What this does not train: the backbone (``distill_kvpop`` in ``train.py`` does, the recipe
for accelerators), the per-head decay ``lambda`` (the boundary pairwise loss's job; it stays
at its initial ``softplus(-7) ~ 1e-3`` per token), and targets under eviction (the targets
are the dense model's, not the sparse student's).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kvjax.losses import regression_loss
from kvjax.scorer_fit.features import TARGETS, FeatureSplit
from kvjax.scorers.build import make_scorer


@dataclass(frozen=True)
class FitConfig:
    features_dir: str = "runs/features/smollm2"   # output of the feature pass (train/ and valid/ inside)
    out_dir: str = "runs/scorers/smollm2-mlp-mean"
    scorer: Literal["mlp", "mlstm"] = "mlp"
    target: Literal["mean", "peak", "union", "recon", "recon_plus"] = "mean"
    steps: int = 300
    lr: float = 3e-3                        # peak learning rate (Adam), after a linear warm-up
    warmup_steps: int = 20
    batch_traces: int = 8                   # traces per step
    seq_len: int = 1024                     # each trace's first seq_len tokens
    centred: bool = True                    # regression up to a per-(trace, head) offset
    hidden: int = 64                        # MLP width
    qk_dim: int = 32                        # mLSTM memory size (d = e)
    chunk: int = 64                         # mLSTM chunkwise block
    sinks: int = 4                          # budget written into the exported scorer_config.json
    topk: int = 220                         #   (policies built from it can change it)
    checkpoint_every: int = 50              # steps between checkpoints (0: only at the end)
    base_model_name: str = "SmolLM2-135M-Instruct"   # recorded in the exported scorer_config.json
    seed: int = 0
    decay: float | None = None              # every head's recency tilt lambda (priority r_t + lambda t); the
    #                                         fit does not train it. None: the scorer's softplus(-7) ~ 9e-4;
    #                                         0 for a target with no recency in it (recon, recon_plus)

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.scorer not in ("mlp", "mlstm"):
            raise ValueError(f"scorer must be 'mlp' or 'mlstm', got {self.scorer!r}")
        if min(self.steps, self.batch_traces, self.seq_len, self.hidden, self.qk_dim, self.chunk) < 1:
            raise ValueError("steps, batch_traces, seq_len, hidden, qk_dim and chunk must be >= 1")
        if self.decay is not None and not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1) per token (or null: the scorer's default), got {self.decay}")


def fit_scorer(cfg: FitConfig, L: int, K: int, D: int):
    """The fit's fresh scorer (:func:`kvjax.scorers.build.make_scorer`), its decay set to ``cfg.decay``."""
    scorer = make_scorer(cfg.scorer, L, K, D, hidden=cfg.hidden, qk_dim=cfg.qk_dim, seed=cfg.seed + 17)
    if cfg.decay is not None:        # rho = softplus^-1(lambda); lambda = 0 as rho = -100 (softplus ~ 4e-44)
        rho = np.log(np.expm1(cfg.decay)) if cfg.decay > 0 else -100.0
        scorer.decay_raw[...] = jnp.full(scorer.decay_raw[...].shape, rho, jnp.float32)
    return scorer


def scorer_scores(scorer, x_BSLKX, lengths_B, window: int, chunk: int):
    """``r_hat float32 [L, B, K, S]`` for features ``x`` (``[k; v]`` per layer and head)."""
    D = x_BSLKX.shape[-1] // 2
    out = []
    for layer in range(x_BSLKX.shape[2]):
        k, v = x_BSLKX[:, :, layer, :, :D], x_BSLKX[:, :, layer, :, D:]
        out.append(scorer.scores(layer, k, v, window, chunk=chunk, lengths_B=lengths_B))
    return jnp.stack(out)


def batch_of(split: FeatureSplit, ids, seq_len: int, target: str):
    """``x bfloat16 [B, S, L, K, 2D]``, ``targets float32 [B, S, L, K]`` (``-inf`` past a
    trace), ``lengths [B]``; ``S = seq_len`` always, padded past each trace.

    A fixed ``S`` compiles the step once: sized to each batch's longest trace, every step
    recompiled (35 s a step for the 30-layer mLSTM instead of 3 s).
    """
    n = np.minimum(split.lengths[ids], seq_len)
    S = seq_len
    L, K, X = split.x.shape[1:]
    x = np.zeros((len(ids), S, L, K, X), split.x_of(0).dtype)
    t = np.full((len(ids), S, L, K), -np.inf, np.float32)
    for b, (i, m) in enumerate(zip(ids, n)):
        x[b, :m] = split.x_of(int(i))[:m]
        t[b, :m] = split.targets_of(int(i), target)[:m]
    return x, t, n.astype(np.int32)


def _loss(scorer, x, tgt_BSLK, lengths, window, chunk, centred):
    r = scorer_scores(scorer, x.astype(jnp.float32), lengths, window, chunk)    # [L, B, K, S]
    tgt = jnp.transpose(tgt_BSLK, (2, 0, 3, 1))                                  # [L, B, K, S]
    return jnp.mean(jax.vmap(lambda a, b: regression_loss(a, b, centred=centred))(r, tgt))


def spearman_by_head(r_hat_LKN: list[np.ndarray], tgt: list[np.ndarray]) -> np.ndarray:
    """Mean over traces of each head's Spearman correlation ``[L, K]`` (tokens with a target)."""
    from scipy.stats import rankdata

    acc = []
    for r, t in zip(r_hat_LKN, tgt):
        ok = np.isfinite(t[0, 0]) & np.isfinite(r[0, 0])
        rr = rankdata(r[..., ok], axis=-1)
        tt = rankdata(t[..., ok], axis=-1)
        rr, tt = rr - rr.mean(-1, keepdims=True), tt - tt.mean(-1, keepdims=True)
        acc.append((rr * tt).sum(-1) / np.sqrt((rr ** 2).sum(-1) * (tt ** 2).sum(-1) + 1e-12))
    return np.mean(acc, axis=0)


def topk_recall_by_head(r_hat_LKN, tgt, keep: float) -> np.ndarray:
    """``[L, K]``: of the ``keep`` fraction of tokens the target ranks highest, the share the
    scores also rank in their top ``keep`` (the seed's Figure 7 retention recall, final-time view)."""
    acc = []
    for r, t in zip(r_hat_LKN, tgt):
        ok = np.isfinite(t[0, 0]) & np.isfinite(r[0, 0])
        n = int(ok.sum())
        k = max(1, int(round(keep * n)))
        top_r = np.argsort(-r[..., ok], axis=-1)[..., :k]
        top_t = np.argsort(-t[..., ok], axis=-1)[..., :k]
        hit = (np.sort(top_r, -1)[..., :, None] == np.sort(top_t, -1)[..., None, :]).any(-1).sum(-1)
        acc.append(hit / k)
    return np.mean(acc, axis=0)


def evaluate(scorer, split: FeatureSplit, cfg: FitConfig, *, keep: float = 0.25, max_traces: int = 32) -> dict:
    """Per-head Spearman and top-``keep`` recall on ``split`` (its first ``max_traces`` traces),
    beside two score-free baselines: K-norm (``-||k_t||``) and chance (``keep``)."""
    graphdef, state = nnx.split(scorer)
    score = jax.jit(lambda st, x, n: scorer_scores(nnx.merge(graphdef, st), x.astype(jnp.float32), n,
                                                   split.window, cfg.chunk))
    r_all, t_all, kn_all = [], [], []
    for i in range(min(len(split), max_traces)):
        x, t, n = batch_of(split, [i], cfg.seq_len, cfg.target)
        r = np.asarray(score(state, jnp.asarray(x), jnp.asarray(n)))[:, 0]          # [L, K, S]
        tt = np.transpose(t[0], (1, 2, 0))                                             # [L, K, S]
        D = x.shape[-1] // 2
        kn = -np.linalg.norm(np.transpose(x[0, :, :, :, :D].astype(np.float32), (1, 2, 0, 3)), axis=-1)
        r_all.append(r), t_all.append(tt), kn_all.append(np.where(np.isfinite(r), kn, -np.inf))
    sp, rec = spearman_by_head(r_all, t_all), topk_recall_by_head(r_all, t_all, keep)
    kn_rec = topk_recall_by_head(kn_all, t_all, keep)
    return {"traces": len(r_all), "keep": keep, "spearman_mean": float(sp.mean()), "recall_mean": float(rec.mean()),
            "knorm_recall_mean": float(kn_rec.mean()), "chance_recall": keep,
            "spearman_by_head": np.round(sp, 3).tolist(), "recall_by_head": np.round(rec, 3).tolist(),
            "knorm_recall_by_head": np.round(kn_rec, 3).tolist()}


def fit_scorers(cfg: FitConfig, *, progress: bool = True, say=print) -> dict:
    """Fit, evaluate on the valid split, export; returns the summary (also ``out_dir/summary.json``)."""
    from kvjax.dir_lock import DirLock
    from kvjax.eviction.config import EvictionConfig
    from kvjax.eviction.learned import from_scorer
    from kvjax.export import export_scorers
    from kvjax.train.checkpoint import write_json_atomic
    from kvjax.train.step_loop import train_task

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = DirLock(out, "scorer fit")
    try:
        train = FeatureSplit(Path(cfg.features_dir) / "train")
        valid_dir = Path(cfg.features_dir) / "valid"
        valid = FeatureSplit(valid_dir) if (valid_dir / "index.json").exists() else None
        T, L, K, X = train.x.shape
        scorer = fit_scorer(cfg, L, K, X // 2)
        graphdef, params = nnx.split(scorer)
        warm = min(cfg.warmup_steps, cfg.steps - 1)
        sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(warm, 1), max(cfg.steps, warm + 2), cfg.lr * 0.1)
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched))
        state = {"params": params, "opt": opt.init(params)}
        meta = {"config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out_dir",)},
                "features": train.index["traces_sha256"], "window": train.window}
        @functools.partial(jax.jit, donate_argnums=0)
        def step(st, x, tgt, n):
            loss, g = jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p), x, tgt, n, train.window, cfg.chunk,
                                                         cfg.centred))(st["params"])
            upd, opt_state = opt.update(g, st["opt"], st["params"])
            return {"params": optax.apply_updates(st["params"], upd), "opt": opt_state}, loss

        rng = np.random.default_rng(cfg.seed)
        order = [rng.choice(len(train), cfg.batch_traces, replace=len(train) < cfg.batch_traces)
                 for _ in range(cfg.steps)]     # step i's traces depend on i only: exact resume

        def step_fn(st, i):
            x, t, n = batch_of(train, order[i], cfg.seq_len, cfg.target)
            st, loss = step(st, jnp.asarray(x), jnp.asarray(t), jnp.asarray(n))
            return st, {"loss": loss}

        t0 = time.time()
        state, result, start = train_task(out, state, step_fn, meta, steps=cfg.steps, desc=f"fit {cfg.scorer}/{cfg.target}",
                                          checkpoint_every=cfg.checkpoint_every, progress=progress, say=say)
        losses = [result["last_metrics"]["loss"]] if "last_metrics" in result else []
        fit_s = time.time() - t0
        scorer = nnx.merge(graphdef, state["params"])
        summary = {"scorer": cfg.scorer, "target": cfg.target, "steps": cfg.steps, "fit_seconds": round(fit_s, 1),
                   "steps_run": cfg.steps - start, "final_loss": losses[-1] if losses else None,
                   "params": int(sum(np.size(a) for a in jax.tree.leaves(state["params"])))}
        if valid is not None:
            summary["valid"] = evaluate(scorer, valid, cfg)
        from kvjax.config import ModelConfig

        policy = from_scorer(scorer, EvictionConfig(sinks=cfg.sinks, window=train.window, topk=cfg.topk),
                             chunk=cfg.chunk, levels=not cfg.centred)
        export_scorers(policy, out / "export", base_model_name=cfg.base_model_name,
                       base_config=ModelConfig.from_hf_config(train.index["model_hf_config"]))
        write_json_atomic(out / "summary.json", summary)
        return summary
    finally:
        lock.release()
