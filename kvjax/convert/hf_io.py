"""Hugging Face folders in and out: ``config.json`` + (sharded) ``model.safetensors``.

Loading reads one tensor at a time (memory-mapped), checks its name and shape against
the key table, converts the layout, casts, and places it (into its ``NamedSharding``
when a mesh is given). Saving writes to a temporary sibling folder and renames it into
place, so a failed save never leaves a half-written folder where a good one was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from kvjax.config import ModelConfig
from kvjax.convert.keys import IGNORED_HF_SUFFIXES, expand_table
from kvjax.models.decoder import Decoder
from kvjax.sharding import named_sharding

SINGLE_FILE = "model.safetensors"
# files that travel with a model folder (tokenizer, chat template, generation defaults)
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")
_SOURCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> the folder it came from


def source_folder(model) -> Path | None:
    """The folder ``model`` was loaded from by :func:`load_hf` (``None`` if built otherwise)."""
    return _SOURCES.get(model)
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE)


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def _weight_map(folder: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it."""
    if (folder / INDEX_FILE).exists():
        index = _read_json(folder / INDEX_FILE)
        if "weight_map" not in index:
            raise ValueError(f"{folder / INDEX_FILE}: no 'weight_map' entry")
        files = {}
        for key, fname in index["weight_map"].items():
            f = folder / fname
            if not f.exists():
                raise FileNotFoundError(f"{f}: shard named in {INDEX_FILE} (for {key!r}) is missing")
            files[key] = f
        return files
    if (folder / SINGLE_FILE).exists():
        with _open_safetensors(folder / SINGLE_FILE) as f:
            return {k: folder / SINGLE_FILE for k in f.keys()}
    raise FileNotFoundError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON (truncated or damaged?): {e}") from None


@contextlib.contextmanager
def _open_safetensors(path: Path):
    """``safe_open`` whose errors name the file (a truncated or damaged one says so)."""
    try:
        handle = safe_open(path, framework="np")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types without the path
        raise ValueError(f"{path}: cannot read safetensors header (truncated or damaged?): {e}") from None
    with handle as f:
        yield f


def read_config(path: str | os.PathLike) -> ModelConfig:
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a model folder")
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file}: missing (a Hugging Face model folder needs config.json)")
    return ModelConfig.from_hf_config(_read_json(cfg_file))


def load_hf(path: str | os.PathLike, *, dtype="float32", compute_dtype=None, mesh=None) -> Decoder:
    """Load a Qwen3 / Llama 3.x Hugging Face folder into a :class:`Decoder`.

    ``dtype`` is the parameter dtype, ``compute_dtype`` (default: ``dtype``) the activation
    dtype; with ``mesh``, each tensor is placed straight into its ``NamedSharding``.
    """
    folder = Path(path)
    cfg = read_config(folder)
    dtype = jnp.dtype(dtype)
    compute_dtype = jnp.dtype(compute_dtype or dtype)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=compute_dtype))
    graphdef, state = nnx.split(abstract)
    table = expand_table(cfg)
    files = _weight_map(folder)

    flat = nnx.to_flat_state(state)
    ours = {_dotted(p) for p, _ in flat}
    missing_rules = ours - table.keys()
    if missing_rules:  # a parameter with no key rule is a bug in the table, not in the checkpoint
        raise RuntimeError(f"key table has no rule for parameters {sorted(missing_rules)}")
    wanted = {hf for hf, _ in table.values()}
    missing = sorted(wanted - files.keys())
    if missing:
        raise KeyError(f"{folder}: checkpoint is missing tensor {missing[0]!r}"
                       + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    ignorable = {k for k in files if k.endswith(IGNORED_HF_SUFFIXES)}
    if cfg.tie_word_embeddings:
        ignorable.add("lm_head.weight")
    extra = sorted(files.keys() - wanted - ignorable)
    if extra:
        raise KeyError(f"{folder}: checkpoint has unexpected tensor {extra[0]!r} for a "
                       f"{cfg.model_type} model" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))

    handles: dict[Path, object] = {}
    with contextlib.ExitStack() as stack:
        for p, var in flat:
            hf_key, tr = table[_dotted(p)]
            f = files[hf_key]
            if f not in handles:
                handles[f] = stack.enter_context(_open_safetensors(f))
            try:
                arr = handles[f].get_tensor(hf_key)
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"{f}: cannot read tensor {hf_key!r} (truncated or damaged?): {e}") from None
            want = tr.hf_shape(var.get_value().shape)
            if tuple(arr.shape) != tuple(want):
                raise ValueError(f"tensor {hf_key!r} has shape {tuple(arr.shape)}, expected {tuple(want)}")
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise ValueError(f"{f}: tensor {hf_key!r} holds NaN or infinite values (damaged weights?)")
            arr = np.ascontiguousarray(tr.to_ours(arr, var.get_value().shape)).astype(dtype)
            if mesh is not None:
                value = jax.device_put(arr, named_sharding(var.logical_axes, arr.shape, mesh))
            else:
                value = jnp.asarray(arr)
            var.set_value(value)
            del arr
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    _SOURCES[model] = folder.resolve()
    return model


def save_hf(model: Decoder, path: str | os.PathLike, *, dtype=None,
            max_shard_bytes: int = 5 * 2**30, tokenizer_from: str | os.PathLike | None = None) -> Path:
    """Write ``model`` as a folder ``transformers.AutoModelForCausalLM`` loads.

    Files above ``max_shard_bytes`` are split as ``model-0000i-of-0000n.safetensors``
    with an index. Other files already in ``path`` (a tokenizer, say) are kept. The
    tokenizer, chat template and generation defaults (:data:`COMPANION_FILES`) of
    ``tokenizer_from`` — by default the folder the model was loaded from — are copied
    where ``path`` has none.
    """
    folder = Path(path)
    cfg: ModelConfig = model.config
    table = expand_table(cfg)
    state = nnx.state(model, nnx.Param)
    out_dtype = None if dtype is None else jnp.dtype(dtype)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        shards: list[dict[str, np.ndarray]] = [{}]
        sizes = [0]
        for p, var in nnx.to_flat_state(state):
            hf_key, tr = table[_dotted(p)]
            arr = np.asarray(jax.device_get(var.get_value()))
            if out_dtype is not None:
                arr = arr.astype(out_dtype)
            arr = np.ascontiguousarray(tr.to_hf(arr))
            if sizes[-1] and sizes[-1] + arr.nbytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1][hf_key] = arr
            sizes[-1] += arr.nbytes
        meta = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_FILE), metadata=meta)
        else:
            weight_map, n = {}, len(shards)
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                save_file(shard, str(tmp / name), metadata=meta)
                weight_map.update({k: name for k in shard})
            (tmp / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}, indent=2))
        hf_cfg = cfg.to_hf_config()
        first = next(iter(shards[0].values()))
        hf_cfg["dtype"] = str(first.dtype)
        hf_cfg.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        src = Path(tokenizer_from) if tokenizer_from is not None else source_folder(model)
        if tokenizer_from is not None and not src.is_dir():
            raise FileNotFoundError(f"tokenizer_from: {src} is not a folder")
        if src is not None and src.resolve() != folder.resolve():
            for name in COMPANION_FILES:
                if (src / name).is_file() and not (folder / name).exists():
                    shutil.copy2(src / name, tmp / name)
        mode = 0o777 & ~current_umask()
        os.chmod(tmp, mode)
        for f in tmp.iterdir():
            os.chmod(f, mode & 0o666)
        _swap_into_place(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _is_weight_file(name: str) -> bool:
    return name in _WEIGHT_FILES or name == "config.json" or (
        name.startswith("model-") and name.endswith(".safetensors"))


def _swap_into_place(tmp: Path, folder: Path) -> None:
    """Replace ``folder`` by ``tmp``; non-weight files of the old folder carry over."""
    if folder.exists():
        if not folder.is_dir():
            raise FileExistsError(f"{folder}: exists and is not a folder")
        for item in folder.iterdir():
            if not _is_weight_file(item.name):
                dst = tmp / item.name
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, dst)
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        folder.rename(old)
        try:
            tmp.rename(folder)
        except BaseException:
            old.rename(folder)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(folder)
