"""Scorer weights out and back in: ``scorers.safetensors`` + ``scorer_config.json``.

Tensor naming (all float32, stacked over layers ``L`` and KV heads ``K``; ``X = 2 * head_dim``):

| scorer | tensors                                                                           |
|--------|-----------------------------------------------------------------------------------|
| mlp    | ``mlp.w1 [L,K,X,F]``, ``mlp.b1 [L,K,F]``, ``mlp.w2 [L,K,F]``, ``mlp.b2 [L,K]``, ``decay_raw [L,K]`` |
| mlstm  | ``mlstm.wq [L,K,X,d]``, ``mlstm.wk [L,K,X,d]``, ``mlstm.wv [L,K,X,e]``, ``mlstm.wi [L,K,X]``, ``mlstm.wf [L,K,X]``, ``mlstm.bi [L,K]``, ``mlstm.bf [L,K]``, ``mlstm.head_w [L,K,e]``, ``mlstm.head_b [L,K]``, ``decay_raw [L,K]`` |

``x = [k; v]`` (post-RoPE key, value) of one token and head. MLP: ``r = w2 . act(x W1 + b1) + b2``.
mLSTM: see :mod:`kvjax.scorers.mlstm` (keys scaled by ``d^-0.5``; readout at ``t + window``).
Priority ``p_t = r_t + softplus(decay_raw) * t``. ``scorer_config.json`` records the type and
sizes, ``sinks``, ``window``, ``topk``, the decays ``lambda [L][K]``, LKV per-head budgets
(``null`` for KVpop), and the base model's name and the SHA-256 of its ``config.json`` fields.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.learned import KVpopMLP, KVpopMLSTM, from_scorer
from kvjax.scorers import MLPScorer, MLSTMScorer

FORMAT_VERSION = 1


def config_hash(model_config) -> str:
    """SHA-256 of a model's HF config fields (order-independent)."""
    return hashlib.sha256(json.dumps(model_config.to_hf_config(), sort_keys=True).encode()).hexdigest()


def _policy_from_run(run_dir: Path):
    """The trained KVpop policy of a ``train.py`` run (``distill_kvpop``), latest checkpoint."""
    from kvjax.configio import from_dict
    from kvjax.train.checkpoint import Checkpointer
    from kvjax.train.config import TrainConfig
    from kvjax.train.loop import meta_for
    from kvjax.train.optim import make_optimizer
    from kvjax.train.tasks import make_task

    cfg_file = run_dir / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{run_dir}: not a train.py run (no config.json)")
    cfg = from_dict(TrainConfig, json.loads(cfg_file.read_text()))
    if cfg.mode != "distill_kvpop":
        raise ValueError(f"{run_dir}: mode {cfg.mode!r} trains no KVpop scorers")
    task = make_task(cfg, abstract=True)
    opt, _ = make_optimizer(cfg.optim, task.params, cfg.total_steps, [p.steps for p in cfg.all_phases()])
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev)  # noqa: E731
    abstract = {"params": jax.tree.map(sds, task.params),
                "opt_state": jax.tree.map(sds, jax.eval_shape(opt.init, task.params))}
    ckpt = Checkpointer(cfg.checkpoint.dir or run_dir / "checkpoints", cfg.checkpoint.keep, async_save=False)
    step = ckpt.latest_step()
    if step is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to export")
    state, _ = ckpt.restore(step, abstract, meta_for(cfg))
    ckpt.close()
    student = nnx.merge(task.graphdef, state["params"])
    ev = EvictionConfig(cfg.eviction.sinks, cfg.eviction.window, cfg.eviction.topk)
    return from_scorer(student.scorers, ev), student.backbone.config, cfg.model.hf_path or cfg.model.preset


def export_scorers(run_or_policy, out_dir, *, base_model_name: str | None = None, base_config=None) -> Path:
    """Write ``scorers.safetensors`` and ``scorer_config.json`` to ``out_dir`` (atomically).

    ``run_or_policy``: a ``train.py`` run folder of mode ``distill_kvpop``, or a KVpop policy
    (``kvjax.eviction.learned.from_scorer(...)``) with ``base_config`` the model's ``ModelConfig``.
    """
    if isinstance(run_or_policy, (str, os.PathLike)):
        policy, base_config, name = _policy_from_run(Path(run_or_policy))
        base_model_name = base_model_name or name
    else:
        policy = run_or_policy
    if not isinstance(policy, (KVpopMLP, KVpopMLSTM)):
        raise TypeError(f"export_scorers: expected a KVpop policy or a run folder, got {type(policy).__name__}")
    scorer = policy.scorer(policy.params)
    kind = "mlp" if isinstance(scorer, MLPScorer) else "mlstm"
    flat = {".".join(str(p) for p in path): np.asarray(jax.device_get(v.get_value()), np.float32)
            for path, v in nnx.to_flat_state(nnx.state(scorer))}
    tensors = {(k if k == "decay_raw" else f"{kind}.{k}"): v for k, v in flat.items()}
    L, K = tensors["decay_raw"].shape
    sizes = ({"hidden": int(tensors["mlp.w1"].shape[-1]), "activation": scorer.activation} if kind == "mlp" else
             {"qk_dim": int(scorer.qk_dim), "v_dim": int(scorer.v_dim), "chunk": policy.chunk})
    ev = policy.config
    meta = {
        "format_version": FORMAT_VERSION, "scorer": kind, "num_layers": int(L), "kv_heads": int(K),
        "head_dim": int(tensors[f"{kind}.{'w1' if kind == 'mlp' else 'wq'}"].shape[2] // 2), **sizes,
        "sinks": ev.sinks, "window": ev.window, "topk": ev.topk,
        "decays": np.log1p(np.exp(tensors["decay_raw"])).tolist(), "lkv_budgets": None,
        "base_model": base_model_name, "base_config_sha256": None if base_config is None else config_hash(base_config),
    }
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "scorers.safetensors"), metadata={"format": "kvjax-scorers"})
        (tmp / "scorer_config.json").write_text(json.dumps(meta, indent=2))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_scorers(directory):
    """The KVpop policy stored by :func:`export_scorers`, ready for ``kvjax.generate``."""
    d = Path(directory)
    for f in ("scorers.safetensors", "scorer_config.json"):
        if not (d / f).exists():
            raise FileNotFoundError(f"{d / f}: missing (written by kvjax.export_scorers)")
    meta = json.loads((d / "scorer_config.json").read_text())
    tensors = load_file(d / "scorers.safetensors")
    L, K, D = meta["num_layers"], meta["kv_heads"], meta["head_dim"]
    kind = meta["scorer"]
    if kind == "mlp":
        make = lambda: MLPScorer(L, K, D, meta["hidden"], activation=meta["activation"], rngs=nnx.Rngs(0))  # noqa: E731
    elif kind == "mlstm":
        make = lambda: MLSTMScorer(L, K, D, meta["qk_dim"], v_dim=meta["v_dim"], rngs=nnx.Rngs(0))  # noqa: E731
    else:
        raise ValueError(f"{d}: unknown scorer type {kind!r}")
    scorer = nnx.eval_shape(make)
    graphdef, state = nnx.split(scorer)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        key = ".".join(str(p) for p in path)
        name = key if key == "decay_raw" else f"{kind}.{key}"
        if name not in tensors:
            raise KeyError(f"{d}: scorers.safetensors is missing tensor {name!r}")
        if tuple(tensors[name].shape) != tuple(var.get_value().shape):
            raise ValueError(f"{d}: tensor {name!r} has shape {tensors[name].shape}, "
                             f"expected {tuple(var.get_value().shape)}")
        var.set_value(jax.numpy.asarray(tensors[name]))
    scorer = nnx.merge(graphdef, nnx.from_flat_state(flat))
    ev = EvictionConfig(meta["sinks"], meta["window"], meta["topk"])
    kw = {"chunk": meta["chunk"]} if kind == "mlstm" else {}
    return from_scorer(scorer, ev, **kw)
