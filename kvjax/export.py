"""Scorer weights out and back in: ``scorers.safetensors`` + ``scorer_config.json``.

Tensor naming (all float32, stacked over layers ``L`` and KV heads ``K``; ``X = 2 * head_dim``):

| scorer | tensors                                                                           |
|--------|-----------------------------------------------------------------------------------|
| mlp    | ``mlp.w1 [L,K,X,F]``, ``mlp.b1 [L,K,F]``, ``mlp.w2 [L,K,F]``, ``mlp.b2 [L,K]``, ``decay_raw [L,K]`` |
| lkv    | ``lkv.w1 [L,K,X,F]``, ``lkv.b1 [L,K,F]``, ``lkv.w2 [L,K,F]`` (LKV-T token MLPs; no decay) |
| mlstm  | ``mlstm.wq [L,K,X,d]``, ``mlstm.wk [L,K,X,d]``, ``mlstm.wv [L,K,X,e]``, ``mlstm.wi [L,K,X]``, ``mlstm.wf [L,K,X]``, ``mlstm.bi [L,K]``, ``mlstm.bf [L,K]``, ``mlstm.head_w [L,K,e]``, ``mlstm.head_b [L,K]``, ``decay_raw [L,K]`` |

``x = [k; v]`` (post-RoPE key, value) of one token and head. MLP: ``r = w2 . act(x W1 + b1) + b2``.
mLSTM: see :mod:`kvjax.scorers.mlstm` (keys scaled by ``d^-0.5``; readout at ``t + window``).
LKV-T: ``u = w2 . silu(x W1 + b1)``. KVpop priority ``p_t = r_t + softplus(decay_raw) * t``;
LKV's is ``u_t``. ``scorer_config.json`` records the policy's registered name, the scorer type and sizes, ``sinks``, ``window``,
``topk``, ``k_max``, the decays ``lambda [L][K]`` (``null`` for LKV), LKV's per-head budgets
``b [L][K]`` (``lkv``, and ``mlstm`` scorers under LKV budgets; else ``null``), and the base
model's name and the SHA-256 of its ``config.json`` fields.
"""

from __future__ import annotations

import dataclasses
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
from kvjax.eviction.policies import REGISTRY

FORMAT_VERSION = 1


from kvjax.config import config_hash  # noqa: E402,F401  (re-exported: kvjax.export.config_hash)


def _policy_from_run(run_dir: Path, step: int | None = None):
    """The trained policy of a ``train.py`` run (``distill_kvpop`` or ``distill_lkv``) at checkpoint
    ``step`` (default the latest): ``(policy, base config, base model name, student backbone or None)``."""
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
    if cfg.mode not in ("distill_kvpop", "distill_lkv"):
        raise ValueError(f"{run_dir}: mode {cfg.mode!r} trains no scorers")
    task = make_task(cfg, abstract=True)
    opt, _ = make_optimizer(cfg.optim, task.params, cfg.total_steps, [p.steps for p in cfg.all_phases()])
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev)  # noqa: E731
    abstract = {"params": jax.tree.map(sds, task.params),
                "opt_state": jax.tree.map(sds, jax.eval_shape(opt.init, task.params))}
    ckpt = Checkpointer(cfg.checkpoint.dir or run_dir / "checkpoints", cfg.checkpoint.keep, async_save=False)
    if step is None:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"{run_dir}: no checkpoint to export")
    elif step not in (steps := ckpt.all_steps()):
        ckpt.close()
        raise FileNotFoundError(f"{run_dir}: no checkpoint at step {step} (kept: {sorted(steps) or 'none'})")
    state, _ = ckpt.restore(step, abstract, meta_for(cfg))
    ckpt.close()
    student = nnx.merge(task.graphdef, state["params"])
    name = cfg.model.hf_path or cfg.model.preset
    if cfg.mode == "distill_lkv":
        from kvjax.eviction.lkv_policies import lkv_policy
        from kvjax.train.distill_lkv import lkv_eviction_config

        policy = lkv_policy(student.lkv.heads, student.lkv.tokens, lkv_eviction_config(cfg))
        return policy, task.model(state["params"]).config, name, None
    from kvjax.train.distill_kvpop import student_policy

    policy = student_policy(student.scorers, cfg)                 # the policy the run trained through
    return policy.at_budget(dataclasses.replace(policy.config, kernel="auto", kernel_interpret=False)), \
        student.backbone.config, name, student.backbone


def export_checkpoint(run_dir, out_dir, step: int) -> tuple[Path, Path | None]:
    """A ``distill_kvpop`` / ``distill_lkv`` run's state at checkpoint ``step``: its scorers in
    ``out_dir/scorers`` and, where the backbone trains (KVpop), the student in ``out_dir/student``
    (an HF folder). Returns both paths (the second None for LKV, whose backbone is frozen)."""
    from kvjax.convert.hf_io import save_hf

    from kvjax.train.checkpoint import weights_fingerprint

    policy, base_config, name, backbone = _policy_from_run(Path(run_dir), step)
    out = Path(out_dir)
    student = None if backbone is None else Path(save_hf(backbone, out / "student"))
    # the scorers remember the adapted backbone they were trained with (load_scorers warns on another)
    trained_with = None if student is None else weights_fingerprint(student)
    scorers = export_scorers(policy, out / "scorers", base_model_name=name, base_config=base_config,
                             trained_with=trained_with)
    return scorers, student


def export_scorers(run_or_policy, out_dir, *, base_model_name: str | None = None, base_config=None,
                   trained_with: str | None = None) -> Path:
    """Write ``scorers.safetensors`` and ``scorer_config.json`` to ``out_dir`` (atomically).

    ``run_or_policy``: a ``train.py`` run folder of mode ``distill_kvpop`` or ``distill_lkv``, or a
    learned policy (``kvpop_mlp``, ``kvpop_mlstm``, ``lkv``, ``lkv_kvpop_mlstm``) with
    ``base_config`` the model's ``ModelConfig``. ``trained_with``: the weights fingerprint of the
    adapted backbone the scorers were trained with (:func:`export_checkpoint` sets it), recorded
    so that :func:`load_scorers` can warn when they are given another backbone.
    """
    if isinstance(run_or_policy, (str, os.PathLike)):
        policy, base_config, name, _ = _policy_from_run(Path(run_or_policy))
        base_model_name = base_model_name or name
    else:
        policy = run_or_policy
    if not hasattr(policy, "export_scorer"):
        raise TypeError(f"export_scorers: expected a learned policy or a run folder, got {type(policy).__name__}")
    scorer, kind = policy.export_scorer(), policy.export_kind
    flat = {".".join(str(p) for p in path): np.asarray(jax.device_get(v.get_value()), np.float32)
            for path, v in nnx.to_flat_state(nnx.state(scorer))}
    tensors = {(k if k == "decay_raw" else f"{kind}.{k}"): v for k, v in flat.items()}
    L, K, X = tensors[f"{kind}.{'wq' if kind == 'mlstm' else 'w1'}"].shape[:3]
    budgets = policy.export_budgets()
    ev = policy.config
    meta = {
        "format_version": FORMAT_VERSION, "policy": policy.name, "scorer": kind, "num_layers": int(L), "kv_heads": int(K),
        "head_dim": int(X // 2), **policy.export_sizes(), "sinks": ev.sinks, "window": ev.window, "topk": ev.topk,
        "k_max": ev.k_max,
        "decays": None if kind == "lkv" else np.log1p(np.exp(tensors["decay_raw"])).tolist(),
        "lkv_budgets": None if budgets is None else np.asarray(budgets).astype(int).tolist(),
        "base_model": base_model_name, "base_config_sha256": None if base_config is None else config_hash(base_config),
        **({} if trained_with is None else {"trained_with_weights": trained_with}),
        **({"levels": bool(policy.levels)} if hasattr(policy, "levels") else {}),
    }
    return write_scorer_files(out_dir, tensors, meta)


def write_scorer_files(out_dir, tensors: dict, meta: dict) -> Path:
    """``scorers.safetensors`` (``tensors``) and ``scorer_config.json`` (``meta``) into ``out_dir``,
    written in a temporary folder and renamed into place (a failure leaves the old export)."""
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


def load_scorers(directory, model=None, *, compression=..., config: EvictionConfig | None = None):
    """The learned policy stored by :func:`export_scorers`, ready for ``kvjax.generate``.

    Its budget, one of:

    - ``compression`` (default :data:`~kvjax.eviction.config.DEFAULT_COMPRESSION`, 0.75): the
      share of the prompt evicted, resolved at the prompt's length by ``generate`` and
      ``TextGenerator``, with the exported sinks and window;
    - ``config``: a fixed budget per KV head (``policy.at_budget(config)``);
    - ``compression=None``: the budget it was exported with (refused for an export without a
      long-range budget, ``topk`` 0, as DMS decisions and DuoAttention gates are written).

    Learned per-head budgets (LKV-H) keep their split at any budget, rescaled. The policy
    remembers the layers, KV heads, head_dim and config hash of the model its scorers were
    exported for: ``generate`` (and ``model=`` here) refuses a model of other shapes and warns
    when only the hash differs.
    """
    from kvjax.eviction.config import DEFAULT_COMPRESSION

    if config is not None and compression is not ... and compression is not None:
        raise ValueError("load_scorers: give compression= or config=, not both")
    policy = _load_scorers(directory)
    if model is not None:
        policy.check_model(getattr(model, "config", model))
        _check_backbone(Path(directory), model)
    if config is not None:
        return policy.at_budget(config)
    if compression is None:
        if policy.config.topk == 0:
            raise ValueError(f"{Path(directory)}: exported without a long-range budget (topk 0: sinks + window "
                             f"only); load it with compression= (e.g. 0.75) or config=EvictionConfig(...)")
        return policy
    return dataclasses.replace(policy, config=dataclasses.replace(policy.config, topk=0, k_max=None),
                               compression=DEFAULT_COMPRESSION if compression is ... else compression)


def _check_backbone(directory: Path, model) -> None:
    """Warn when scorers trained with an adapted backbone (``trained_with_weights``) are given a
    model loaded from a folder whose weights differ (the frozen original, say): legal, since the
    shapes fit, but not the pair that was trained."""
    import warnings

    from kvjax.convert.hf_io import source_folder
    from kvjax.train.checkpoint import weights_fingerprint

    want = json.loads((directory / "scorer_config.json").read_text()).get("trained_with_weights")
    folder = source_folder(model)
    if want is None or folder is None:
        return
    got = weights_fingerprint(folder)
    if got != want:
        warnings.warn(f"{directory}: these scorers were trained with an adapted backbone (weights {want}); the model "
                      f"given was loaded from {folder} (weights {got}): they run, but not as the pair that was trained",
                      stacklevel=3)


_META_INTS = ("num_layers", "kv_heads", "head_dim", "sinks", "window", "topk")


def _check_meta(path: Path, meta) -> None:
    """Refuse a ``scorer_config.json`` of another format or with missing or wrong-typed fields."""
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    version = meta.get("format_version")
    if version is None:
        raise ValueError(f"{path}: no 'format_version' field (not written by kvjax.export_scorers?)")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{path}: 'format_version' must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {version} is newer than this kvjax reads ({FORMAT_VERSION}); "
                         "upgrade kvjax or export the scorers again")
    if not isinstance(meta.get("scorer"), str):
        raise ValueError(f"{path}: missing or non-string field 'scorer' (the scorer type, e.g. 'mlp')")
    for key in _META_INTS:
        v = meta.get(key)
        if key == "head_dim" and v is None and meta["scorer"] == "duo":
            continue
        if key not in meta:
            raise ValueError(f"{path}: missing field {key!r}")
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key in ("sinks", "topk") else 1):
            raise ValueError(f"{path}: field {key!r} must be a {'non-negative' if key in ('sinks', 'topk') else 'positive'} "
                             f"integer, got {v!r}")
    k_max = meta.get("k_max")
    if k_max is not None and (isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < meta["topk"]):
        raise ValueError(f"{path}: field 'k_max' must be null or an integer >= topk ({meta['topk']}), got {k_max!r}")


def _load_scorers(directory):
    d = Path(directory)
    for f in ("scorers.safetensors", "scorer_config.json"):
        if not (d / f).exists():
            raise FileNotFoundError(f"{d / f}: missing (written by kvjax.export_scorers)")
    try:
        meta = json.loads((d / "scorer_config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{d / 'scorer_config.json'}: not valid JSON (truncated or damaged?): {e}") from None
    _check_meta(d / "scorer_config.json", meta)
    try:
        tensors = load_file(d / "scorers.safetensors")
    except Exception as e:  # noqa: BLE001 - safetensors' errors do not name the file
        raise ValueError(f"{d / 'scorers.safetensors'}: cannot read it (truncated or damaged?): {e}") from None
    bad = sorted(k for k, v in tensors.items() if v.dtype.kind == "f" and not np.isfinite(v).all())
    if bad:
        raise ValueError(f"{d / 'scorers.safetensors'}: tensor {bad[0]!r} holds NaN or infinite values")
    L, K, D = meta["num_layers"], meta["kv_heads"], meta["head_dim"]
    kind = meta["scorer"]
    if kind == "dms":                 # DMS's decision heads (kvjax.dms.export_decisions)
        w, b = tensors.get("dms.w"), tensors.get("dms.b")
        if w is None or b is None or w.shape != (L, K, 2 * D) or b.shape != (L, K):
            raise ValueError(f"{d}: scorers.safetensors needs 'dms.w' {(L, K, 2 * D)} and 'dms.b' {(L, K)}")
        ev = EvictionConfig(meta["sinks"], meta["window"], meta["topk"])
        return REGISTRY["dms"](ev, params={"w": jax.numpy.asarray(w), "b": jax.numpy.asarray(b)},
                               fits=(int(L), int(K), int(D), meta.get("base_config_sha256")))
    if kind == "duo":                 # DuoAttention's gates (kvjax.duo.export_gates)
        gates = tensors.get("duo.gates")
        if gates is None or gates.shape != (L, K):
            raise ValueError(f"{d}: scorers.safetensors needs tensor 'duo.gates' of shape {(L, K)}")
        ev = EvictionConfig(meta["sinks"], meta["window"], meta["topk"], k_max=meta.get("k_max"))
        return REGISTRY["duo_attention"](ev, params={"gates": jax.numpy.asarray(gates)},
                                         fits=None if D is None else (int(L), int(K), int(D),
                                                                      meta.get("base_config_sha256")))
    # exports before the "policy" field: the scorer type (and LKV budgets on an mLSTM) name it
    name = meta.get("policy") or {"mlp": "kvpop_mlp", "lkv": "lkv",
                                  "mlstm": "kvpop_mlstm" if meta.get("lkv_budgets") is None else "lkv_kvpop_mlstm"
                                  }.get(kind)
    cls = REGISTRY.get(name)
    if cls is None or getattr(cls, "export_kind", None) != kind:
        raise ValueError(f"{d}: unknown scorer type {kind!r}" + (f" for policy {name!r}" if name else ""))
    try:
        scorer = nnx.eval_shape(lambda: cls.make_scorer(meta))
    except KeyError as e:
        raise ValueError(f"{d / 'scorer_config.json'}: missing field {e.args[0]!r} (the {kind} scorer's sizes)") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{d / 'scorer_config.json'}: a {kind} scorer size has the wrong type or value: {e}") from None
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
    ev = EvictionConfig(meta["sinks"], meta["window"], meta["topk"], k_max=meta.get("k_max"))
    budgets = meta.get("lkv_budgets")
    if budgets is not None:
        budgets = jax.numpy.asarray(budgets, jax.numpy.int32)
        if budgets.shape != (L, K):
            raise ValueError(f"{d}: lkv_budgets has shape {budgets.shape}, expected {(L, K)}")
    fits = (int(L), int(K), int(D), meta.get("base_config_sha256"))
    try:
        return cls.from_export(scorer, ev, meta, budgets, fits)
    except KeyError as e:
        raise ValueError(f"{d / 'scorer_config.json'}: missing field {e.args[0]!r}") from None


def combine_lkv_budgets(lkv_dir, kvpop_mlstm_dir, out_dir) -> Path:
    """Export ``lkv_kvpop_mlstm``: the per-head budgets (and ``k_max``, budget) of an exported
    ``lkv`` policy with the token scorer of an exported ``kvpop_mlstm`` one."""

    lkv, kvpop = load_scorers(lkv_dir, compression=None), load_scorers(kvpop_mlstm_dir, compression=None)
    if lkv.name != "lkv":
        raise ValueError(f"{lkv_dir}: expected exported LKV scorers (scorer 'lkv'), got {lkv.name!r}")
    if kvpop.name != "kvpop_mlstm":
        raise ValueError(f"{kvpop_mlstm_dir}: expected exported KVpop mLSTM scorers, got {kvpop.name!r}")
    if tuple(lkv.params["budgets"].shape) != tuple(kvpop.scorer(kvpop.params).wi[...].shape[:2]):
        raise ValueError(f"{lkv_dir} and {kvpop_mlstm_dir} were trained for different models (budget shape "
                         f"{tuple(lkv.params['budgets'].shape)})")
    ev = dataclasses.replace(kvpop.config, sinks=lkv.config.sinks, window=lkv.config.window, topk=lkv.config.topk,
                             k_max=lkv.config.k_max)
    combo = REGISTRY["lkv_kvpop_mlstm"](ev, params={"budgets": lkv.params["budgets"], "scorer": kvpop.params},
                                 scorer_def=kvpop.scorer_def, chunk=kvpop.chunk, budgets_at=lkv.budgets_at)
    meta = json.loads((Path(kvpop_mlstm_dir) / "scorer_config.json").read_text())
    return export_scorers(combo, out_dir, base_model_name=meta.get("base_model"))
