"""DuoAttention's gate optimisation (Xiao et al. 2024, arXiv:2410.10819, section 3.2).

The model is frozen. Every KV head ``(l, h)`` gets a gate ``alpha_lh`` (initialised to 1) that
mixes its attention outputs, per query head of its group,

    attn = alpha_lh * full_attn + (1 - alpha_lh) * streaming_attn,

where streaming attention sees only the ``sinks`` first tokens and the ``window`` most recent.
The gates minimise, on passkey retrieval sequences (:mod:`kvjax.duo.passkey`),

    L = L_distill + lambda * sum_lh |alpha_lh|,
    L_distill = mean over the positions j predicting the answer of sum_e (H_full[j, e] - H_mixed[j, e])^2,

``H`` the final hidden states of the full model and of the gated one (the paper sums over the
last ``l`` positions; the mean over the answer's positions keeps ``lambda`` independent of the
answer's length). Adam (lr 0.02, the paper's), gates clamped to ``[0, 1]`` after every step,
``lambda = 0.05`` (the paper's). A task of the one training loop, checkpointed
every ``save_every`` steps and resumable.
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

from kvjax.models.attention import dense_attention
from kvjax.data.config import TestbedConfig, testbed_field


@dataclass(frozen=True)
class DuoConfig:
    steps: int = 120                  # one sequence per step (the paper: 2,000 on 8B models)
    length: int = 1024                # tokens per passkey sequence
    passkeys: int = 10                # the paper's multi_passkey10
    batch_size: int = 1               # sequences per step
    testbed: TestbedConfig | None = None       # TestbedConfig fields: train on testbed problems (train split; the
    #                                   distillation over the lookups and the answer line) instead of passkeys
    lr: float = 0.02
    reg: float = 0.05                 # lambda of the L1 term
    sinks: int = 4                    # streaming attention: the evaluation's sinks and window
    window: int = 32
    seed: int = 0
    save_every: int = 10
    model_dir: str | None = None      # HF folder; default: SmolLM2 via kvjax.real_model
    work_dir: str = "runs/duo/smollm2"        # progress (resumable)
    out_dir: str = "assets/smollm2-duo"       # the exported gates (kvjax.load_scorers reads them)

    def __post_init__(self):
        for name in ("steps", "length", "passkeys", "batch_size", "save_every", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"duo: {name} must be a positive integer, got {v!r}")
        if self.sinks < 0:
            raise ValueError(f"duo: sinks must be >= 0, got {self.sinks}")
        if not self.lr > 0 or not self.reg >= 0:
            raise ValueError(f"duo: lr must be > 0 and reg >= 0, got lr={self.lr}, reg={self.reg}")
        object.__setattr__(self, "testbed", testbed_field(self.testbed, "duo", self.length, "length"))


def streaming_visible(positions_BS, sinks: int, window: int):
    """``bool [B, S, S]``: key ``t`` visible to query ``s`` under streaming attention (sink or
    within the window; causality is applied by the attention)."""
    p = positions_BS
    return (p[:, None, :] < sinks) | (p[:, None, :] > p[:, :, None] - window)


def mixed_attention_backend(sinks: int, window: int):
    """A no-cache attention backend whose state is the gates ``[L, K]``: each layer's output is
    the gated mix of full and streaming attention (the module docstring)."""

    def backend(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, gates_LK):
        full, _ = dense_attention(q_BSHD, k_BSKD, v_BSKD, positions_BS, positions_BS, prefill=True)
        vis = streaming_visible(positions_BS, sinks, window)
        stream, _ = dense_attention(q_BSHD, k_BSKD, v_BSKD, positions_BS, positions_BS, visible_BST=vis, prefill=True)
        G = q_BSHD.shape[2] // k_BSKD.shape[2]                      # query head h reads KV head h // G
        a = jnp.repeat(gates_LK[layer], G)[None, None, :, None].astype(full.dtype)
        return a * full + (1 - a) * stream, gates_LK

    return backend


def duo_loss(gates_LK, model, tokens_BS, mask_BS, teacher_BSE, reg: float, sinks: int, window: int):
    """``(L, L_distill)`` of the module docstring for one batch (``mask``: the answer positions)."""
    h, _ = model(tokens_BS, None, mixed_attention_backend(sinks, window), gates_LK)
    err = jnp.sum(jnp.square(h.astype(jnp.float32) - teacher_BSE.astype(jnp.float32)), axis=-1)
    distill = jnp.sum(err * mask_BS) / jnp.maximum(jnp.sum(mask_BS), 1)
    return distill + reg * jnp.sum(jnp.abs(gates_LK)), distill


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("reg", "sinks", "window"))
def _step(graphdef, opt, params, gates, opt_state, tokens, mask, *, reg, sinks, window):
    model = nnx.merge(graphdef, params)
    teacher, _ = model(tokens)
    teacher = jax.lax.stop_gradient(teacher)
    (loss, distill), grad = jax.value_and_grad(duo_loss, has_aux=True)(gates, model, tokens, mask, teacher, reg,
                                                                       sinks, window)
    updates, opt_state = opt.update(grad, opt_state, gates)
    return jnp.clip(optax.apply_updates(gates, updates), 0.0, 1.0), opt_state, loss, distill


def train_gates(model, batch_at, cfg: DuoConfig, *, progress: bool = True) -> dict:
    """Optimise the gates: ``batch_at(step) -> (tokens int [B, S], answer mask [B, S])``.
    A task of the one training loop (:mod:`kvjax.train.step_loop`): checkpoints and
    ``metrics.jsonl`` under ``cfg.work_dir``, resumed from there (also into more ``steps``: the
    learning rate is constant); returns ``{"gates": [L, K], "history": [[loss, distill], ...]}``."""
    from kvjax.config import config_hash
    from kvjax.train.step_loop import logged_history, train_task

    c = model.config
    gates = jnp.ones((c.num_layers, c.num_kv_heads), jnp.float32)
    opt = optax.adam(cfg.lr)
    graphdef, params = nnx.split(model)

    def step_fn(st, step):
        tokens, mask = batch_at(step)
        gates, opt_state, loss, distill = _step(graphdef, opt, params, st["gates"], st["opt"], jnp.asarray(tokens),
                                                jnp.asarray(mask, jnp.float32), reg=cfg.reg, sinks=cfg.sinks,
                                                window=cfg.window)
        return {"gates": gates, "opt": opt_state}, {"loss": loss, "distill": distill, "gates": gates.mean()}

    meta = {"task": "duo", "model": config_hash(c),
            "config": {k: v for k, v in asdict(cfg).items()
                       if k not in ("steps", "work_dir", "out_dir", "save_every", "model_dir")}}
    state, _, _ = train_task(cfg.work_dir, {"gates": gates, "opt": opt.init(gates)}, step_fn, meta, steps=cfg.steps,
                             desc="duo gates", checkpoint_every=cfg.save_every, progress=progress,
                             postfix=("distill", "gates"))
    return {"gates": np.asarray(state["gates"]),
            "history": logged_history(cfg.work_dir, ("loss", "distill"))[:cfg.steps]}


def export_gates(gates_LK, out_dir, *, sinks: int, window: int, base_config=None, base_model_name=None,
                 training: dict | None = None) -> Path:
    """Write ``scorers.safetensors`` (``duo.gates [L, K]``) and ``scorer_config.json`` (policy
    ``duo_attention``) atomically; ``kvjax.load_scorers(out_dir)`` returns the policy."""
    from kvjax.config import config_hash
    from kvjax.export import write_scorer_files

    g = np.asarray(gates_LK, np.float32)
    if g.ndim != 2 or not np.isfinite(g).all():
        raise ValueError(f"export_gates: gates must be a finite [layers, kv_heads] array, got shape {g.shape}")
    L, K = g.shape
    meta = {"format_version": 1, "policy": "duo_attention", "scorer": "duo", "num_layers": L, "kv_heads": K,
            "head_dim": None if base_config is None else base_config.head_dim, "sinks": sinks, "window": window,
            "topk": 0, "k_max": None, "base_model": base_model_name,
            "base_config_sha256": None if base_config is None else config_hash(base_config), "training": training}
    return write_scorer_files(out_dir, {"duo.gates": g}, meta)


def passkey_batches(tok, cfg: DuoConfig):
    """``batch_at(step)``: ``cfg.batch_size`` passkey sequences (:mod:`kvjax.duo.passkey`) padded to
    ``cfg.length``; the mask marks the hidden states that predict each answer's tokens."""
    from kvjax.duo.passkey import passkey_sequence
    from kvjax.longctx.tasks import _Counter

    counter = _Counter(tok)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else 0)

    def batch_at(step):
        tokens = np.full((cfg.batch_size, cfg.length), pad, np.int32)
        mask = np.zeros((cfg.batch_size, cfg.length), np.float32)
        for b in range(cfg.batch_size):
            ids, start = passkey_sequence(tok, cfg.length, step * cfg.batch_size + b, n_keys=cfg.passkeys,
                                          seed=cfg.seed, counter=counter)
            if len(ids) > cfg.length:
                raise ValueError(f"a passkey sequence came out at {len(ids)} tokens, over length={cfg.length}")
            tokens[b, :len(ids)] = ids
            mask[b, start - 1:len(ids) - 1] = 1.0
        return tokens, mask

    return batch_at


def run_duo(cfg: DuoConfig, *, model=None, tokenizer=None, progress: bool = True) -> dict:
    """Train SmolLM2's (or ``cfg.model_dir``'s) gates on passkey sequences (or on testbed
    problems, ``cfg.testbed``) and export them."""
    import transformers

    import kvjax
    from kvjax.real_model import ensure_model

    folder = Path(cfg.model_dir) if cfg.model_dir else None
    if cfg.testbed is not None:
        from kvjax.data import step_batches

        if model is None:
            if folder is None:
                raise ValueError("duo: testbed training needs model_dir (the testbed teacher, e.g. "
                                 "assets/testbed-teacher)")
            model = kvjax.load_hf(folder)
        batch_at = step_batches(cfg.testbed, "train", cfg.batch_size, cfg.length,
                                positions="retrieval")
    else:
        if model is None or tokenizer is None:
            folder = folder or ensure_model()
        model = model or kvjax.load_hf(folder)
        batch_at = passkey_batches(tokenizer or transformers.AutoTokenizer.from_pretrained(folder), cfg)

    t0 = time.time()
    out = train_gates(model, batch_at, cfg, progress=progress)
    g = out["gates"]
    training = {**asdict(cfg), "seconds_this_run": round(time.time() - t0, 1),
                "final_distill": out["history"][-1][1], "first_distill": out["history"][0][1]}
    export_gates(g, cfg.out_dir, sinks=cfg.sinks, window=cfg.window, base_config=model.config,
                 base_model_name=str(folder) if folder else None, training=training)
    return {"gates": g.tolist(), "history": out["history"], "out_dir": cfg.out_dir}
