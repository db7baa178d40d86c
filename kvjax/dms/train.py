"""DMS's training (Lancucki et al. 2025, arXiv:2506.05345, section 3), decision heads only.

The model is frozen; per layer and KV head a linear decision ``a_t = w . [k_t; v_t] + b``
(:mod:`kvjax.eviction.dms`) is trained on the model's own traces (the same data as KVpop's
scorers). Per training sequence and layer:

    alpha_t = sigmoid((a_t + log u - log(1 - u)) / tau),  u ~ U(0, 1)    (Gumbel-sigmoid)
    attention logit of query q on key t  +=  log(1 - alpha_t)   if q - t >= window and t >= sinks

(delayed eviction: a token stays fully visible to the ``window`` queries after it; sinks are
never evicted, as in every kvjax policy). The loss is

    L = KL(dense || student) over the sequence  +  relu(target_t - mean alpha) * aux_weight,

``target_t`` ramping linearly from 0 to ``target`` over the first ``ramp`` of the steps (DMS
raises the compression gradually), the mean over the tokens that can be evicted. Adam; a task
of the one training loop, checkpointed every ``save_every`` steps and resumable.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kvjax.eviction.dms import dms_logits
from kvjax.losses import kl_distill
from kvjax.data.config import TestbedConfig, testbed_field
from pallas_kernels.reference import grouped_attention


@dataclass(frozen=True)
class DMSConfig:
    steps: int = 150
    seq_len: int = 512                # tokens per training row (traces cut to this length)
    batch_size: int = 2
    lr: float = 1e-2
    tau: float = 0.5                  # Gumbel-sigmoid temperature
    target: float = 0.75              # eviction rate aimed at (75% compression)
    ramp: float = 0.5                 # share of the steps over which the target ramps up from 0
    aux_weight: float = 1.0
    init_bias: float = -4.0           # alpha ~ 0.02 at the start: the student begins as the dense model
    sinks: int = 4
    window: int = 32                  # the eviction delay (kvjax's protected window)
    seed: int = 0
    save_every: int = 10
    traces: str = "assets/smollm2-traces/train.jsonl"
    valid_traces: str | None = "assets/smollm2-traces/valid.jsonl"   # the ragged-memory measurement
    testbed: TestbedConfig | None = None       # TestbedConfig fields: train on testbed problems (the train split;
    #                                   ragged memory on 64 of the valid split) instead of traces
    model_dir: str | None = None      # HF folder; default: SmolLM2 via kvjax.real_model
    work_dir: str = "runs/dms/smollm2"
    out_dir: str = "assets/smollm2-dms"

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch_size", "save_every", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"dms: {name} must be a positive integer, got {v!r}")
        if not 0.0 < self.target < 1.0 or not 0.0 <= self.ramp <= 1.0 or not self.tau > 0 or not self.lr > 0:
            raise ValueError(f"dms: need 0 < target < 1, 0 <= ramp <= 1, tau > 0, lr > 0 (got target={self.target}, "
                             f"ramp={self.ramp}, tau={self.tau}, lr={self.lr})")
        # a mapping (programmatic use) becomes a TestbedConfig: hashable, as a jit static argument
        object.__setattr__(self, "testbed", testbed_field(self.testbed, "dms", self.seq_len, "seq_len"))


def init_decisions(cfg_model, init_bias: float, seed: int = 0) -> dict:
    """``{"w": [L, K, 2D] (small random), "b": [L, K] = init_bias}``."""
    L, K, D = cfg_model.num_layers, cfg_model.num_kv_heads, cfg_model.head_dim
    w = 0.01 * jax.random.normal(jax.random.key(seed), (L, K, 2 * D), jnp.float32)
    return {"w": w, "b": jnp.full((L, K), init_bias, jnp.float32)}


def evictable(S: int, sinks: int, window: int):
    """``bool [S, S]``: query ``q`` may have key ``t`` evicted (``q - t >= window``, ``t >= sinks``)."""
    q, t = np.arange(S)[:, None], np.arange(S)[None, :]
    return jnp.asarray((q - t >= window) & (t >= sinks))


def soft_eviction_backend(decisions, key, sinks: int, window: int, tau: float):
    """A no-cache backend: causal attention whose weights on key ``t`` are scaled by
    ``1 - alpha_t`` for the queries it may be evicted for; state: the per-layer mean ``alpha``
    over evictable tokens."""

    def backend(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, acc):
        S = q_BSHD.shape[1]
        a = dms_logits(decisions["w"][layer], decisions["b"][layer], k_BSKD, v_BSKD)            # [B, K, S]
        u = jax.random.uniform(jax.random.fold_in(key, layer), a.shape, minval=1e-6, maxval=1 - 1e-6)
        z = (a + jnp.log(u) - jnp.log1p(-u)) / tau
        alpha = jax.nn.sigmoid(z)
        ev = evictable(S, sinks, window)                  # log(1 - alpha) = log sigmoid(-z), exact when alpha ~ 1
        logw = jnp.where(ev[None, None, None], jax.nn.log_sigmoid(-z)[:, :, None, None, :], 0.0)
        causal = positions_BS[:, None, :] <= positions_BS[:, :, None]                         # [B, S, T]
        out, _, _ = grouped_attention(q_BSHD, k_BSKD, v_BSKD, allowed=causal[:, None, None], log_weights=logw)
        t_ok = (jnp.arange(S) >= sinks) & (jnp.arange(S) < S - window)
        return out, acc + (jnp.sum(alpha * t_ok) / (alpha.shape[0] * alpha.shape[1] * jnp.sum(t_ok)),)

    return backend


def dms_loss(decisions, model, tokens_BS, mask_BS, teacher_BSV, key, target, cfg: DMSConfig):
    """``(L, (kl, mean alpha))`` of the module docstring for one batch."""
    h, rates = model(tokens_BS, None, soft_eviction_backend(decisions, key, cfg.sinks, cfg.window, cfg.tau), ())
    kl = kl_distill(teacher_BSV, model.logits(h), mask_BS)
    rate = sum(rates) / len(rates)
    return kl + cfg.aux_weight * jax.nn.relu(target - rate), (kl, rate)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _step(graphdef, opt, cfg, params, decisions, opt_state, tokens, mask, key, target):
    model = nnx.merge(graphdef, params)
    th, _ = model(tokens)
    teacher = jax.lax.stop_gradient(model.logits(th))
    (loss, (kl, rate)), grad = jax.value_and_grad(dms_loss, has_aux=True)(decisions, model, tokens, mask, teacher,
                                                                          key, target, cfg)
    updates, opt_state = opt.update(grad, opt_state, decisions)
    return optax.apply_updates(decisions, updates), opt_state, loss, kl, rate


def train_decisions(model, batch_at, cfg: DMSConfig, *, progress: bool = True) -> dict:
    """Train the decision heads: ``batch_at(step) -> (tokens int [B, S], loss mask [B, S])``.
    A task of the one training loop (:mod:`kvjax.train.step_loop`): checkpoints and
    ``metrics.jsonl`` under ``cfg.work_dir``, resumed from there; returns ``{"w", "b",
    "history": [[loss, kl, rate], ...]}``."""
    from kvjax.config import config_hash
    from kvjax.train.step_loop import logged_history, train_task

    decisions = init_decisions(model.config, cfg.init_bias, cfg.seed)
    opt = optax.adam(cfg.lr)
    graphdef, params = nnx.split(model)
    ramp_steps = max(1, int(cfg.ramp * cfg.steps))

    def step_fn(st, step):
        tokens, mask = batch_at(step)
        target = cfg.target * min(1.0, (step + 1) / ramp_steps)
        decisions, opt_state, loss, kl, rate = _step(
            graphdef, opt, cfg, params, st["decisions"], st["opt"], jnp.asarray(tokens),
            jnp.asarray(mask, jnp.float32), jax.random.fold_in(jax.random.key(cfg.seed), step), jnp.float32(target))
        return {"decisions": decisions, "opt": opt_state}, {"loss": loss, "kl": kl, "rate": rate,
                                                            "target": jnp.float32(target)}

    meta = {"task": "dms", "model": config_hash(model.config),
            "config": {k: v for k, v in asdict(cfg).items()
                       if k not in ("work_dir", "out_dir", "save_every", "model_dir", "valid_traces")}}
    state, _, _ = train_task(cfg.work_dir, {"decisions": decisions, "opt": opt.init(decisions)}, step_fn, meta,
                             steps=cfg.steps, desc="dms decisions", checkpoint_every=cfg.save_every,
                             progress=progress, postfix=("kl", "rate", "target"))
    d = state["decisions"]
    return {"w": np.asarray(d["w"]), "b": np.asarray(d["b"]),
            "history": logged_history(cfg.work_dir, ("loss", "kl", "rate"))}


def export_decisions(w, b, out_dir, *, sinks: int, window: int, base_config=None, base_model_name=None,
                     training: dict | None = None) -> Path:
    """``scorers.safetensors`` (``dms.w [L, K, 2D]``, ``dms.b [L, K]``) and ``scorer_config.json``
    (policy ``dms``), atomically; ``kvjax.load_scorers(out_dir)`` returns the policy."""
    from kvjax.config import config_hash
    from kvjax.export import write_scorer_files

    w, b = np.asarray(w, np.float32), np.asarray(b, np.float32)
    if w.ndim != 3 or b.shape != w.shape[:2] or not (np.isfinite(w).all() and np.isfinite(b).all()):
        raise ValueError(f"export_decisions: need finite w [L, K, 2D] and b [L, K], got {w.shape} and {b.shape}")
    L, K, X = w.shape
    meta = {"format_version": 1, "policy": "dms", "scorer": "dms", "num_layers": L, "kv_heads": K, "head_dim": X // 2,
            "sinks": sinks, "window": window, "topk": 0, "k_max": None, "base_model": base_model_name,
            "base_config_sha256": None if base_config is None else config_hash(base_config), "training": training}
    return write_scorer_files(out_dir, {"dms.w": w, "dms.b": b}, meta)


def trace_batches(path, seq_len: int, batch_size: int, seed: int, pad_id: int = 0):
    """``batch_at(step)``: rows of the traces at ``path`` (each cut to ``seq_len`` tokens), in a
    seeded order that reshuffles every epoch; the loss mask covers each row's real tokens."""
    import json

    rows = [json.loads(line)["tokens"][:seq_len] for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no traces")

    def batch_at(step):
        tokens = np.full((batch_size, seq_len), pad_id, np.int32)
        mask = np.zeros((batch_size, seq_len), np.float32)
        for i in range(batch_size):
            j = step * batch_size + i
            order = np.random.RandomState([seed, j // len(rows)]).permutation(len(rows))
            r = rows[order[j % len(rows)]]
            tokens[i, :len(r)], mask[i, :len(r) - 1] = r, 1.0
        return tokens, mask

    return batch_at


def _training_data(cfg: DMSConfig):
    """``(batch_at, held-out token sequences)``: the traces, or testbed problems (``cfg.testbed``)."""
    import json

    if cfg.testbed is not None:
        from kvjax.data import generate_problem, step_batches

        tb = cfg.testbed
        valid = [generate_problem(tb, "valid", i).tokens.tolist() for i in range(64)]
        return step_batches(tb, "train", cfg.batch_size, cfg.seq_len), valid
    valid = []
    if cfg.valid_traces:
        valid = [json.loads(line)["tokens"] for line in Path(cfg.valid_traces).read_text().splitlines() if line.strip()]
    return trace_batches(cfg.traces, cfg.seq_len, cfg.batch_size, cfg.seed), valid


def run_dms(cfg: DMSConfig, *, model=None, progress: bool = True) -> dict:
    """Train SmolLM2's (or ``cfg.model_dir``'s) DMS decisions on its traces (or on testbed
    problems) and export them, with the ragged-memory measurement on held-out sequences."""
    import kvjax
    from kvjax.real_model import ensure_model

    folder = Path(cfg.model_dir) if cfg.model_dir else None
    if model is None:
        if cfg.testbed is not None and folder is None:
            raise ValueError("dms: testbed training needs model_dir (the testbed teacher, e.g. assets/testbed-teacher)")
        folder = folder or ensure_model()
        model = kvjax.load_hf(folder)
    batch_at, valid = _training_data(cfg)
    t0 = time.time()
    out = train_decisions(model, batch_at, cfg, progress=progress)
    h = out["history"]
    training = {**asdict(cfg), "seconds_this_run": round(time.time() - t0, 1), "final": h[-1], "first": h[0]}
    path = export_decisions(out["w"], out["b"], cfg.out_dir, sinks=cfg.sinks, window=cfg.window,
                            base_config=model.config, base_model_name=str(folder) if folder else None,
                            training=training)
    memory = None
    seqs = [s for s in valid if len(s) > cfg.sinks + cfg.window]
    if seqs:
        import json

        from kvjax.dms.memory import kept_fractions, ragged_memory
        from kvjax.export import load_scorers

        f = kept_fractions(model, load_scorers(path), seqs, sinks=cfg.sinks, window=cfg.window)
        memory = {**ragged_memory(f, [len(s) for s in seqs], sinks=cfg.sinks, window=cfg.window),
                  "sequences": len(seqs), "kept_fraction_by_head": f.mean(0).round(3).tolist()}
        (path / "ragged_memory.json").write_text(json.dumps(memory, indent=1))
    return {**out, "out_dir": cfg.out_dir, "ragged_memory": memory}
