"""Orbax checkpoints: train state + JSON metadata (step, config, data position) saved
together, asynchronously, keeping the last N; restore refuses what does not fit."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, or read back into this run."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read (as opposed to one of another run)."""


_DISK_FULL = ("No space left", "ENOSPC", "File too large", "EFBIG", "Disk quota exceeded", "EDQUOT")


def _cause(e: Exception) -> str:
    """The error text, with the likely cause named when the disk (or a quota/limit) is full."""
    text = f"{type(e).__name__}: {e}"
    chain, seen = e, 0
    while chain is not None and seen < 10:
        if getattr(chain, "errno", None) in (28, 27, 122) or any(m in str(chain) for m in _DISK_FULL):
            return f"no space left or file-size limit reached on the checkpoint disk ({text})"
        chain, seen = chain.__cause__ or chain.__context__, seen + 1
    return text


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int, *, async_save: bool = True):
        self.dir = Path(directory).absolute()
        self.mngr = ocp.CheckpointManager(
            self.dir,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True),
            item_names=("state", "meta"))
        self._pending: int | None = None   # step of an asynchronous save not yet finished

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.mngr.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        self._pending = step
        try:
            self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001 - reported with the path, previous checkpoints stay
            raise CheckpointError(f"saving checkpoint step {step} under {self.dir} failed: {_cause(e)}; "
                                  f"earlier checkpoints are untouched") from e

    def wait(self) -> None:
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"saving checkpoint step {self._pending} under {self.dir} failed: {_cause(e)}; "
                                  f"earlier checkpoints are untouched") from e
        self._pending = None

    def restore(self, step: int, abstract_state, expect_meta: dict) -> tuple[object, dict]:
        """Restore ``step`` into the structure/shapes/shardings of ``abstract_state``."""
        try:
            meta = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001
            raise DamagedCheckpoint(f"checkpoint step {step} under {self.dir} is corrupt or incomplete "
                                    f"(metadata unreadable: {e})") from e
        for key, want in expect_meta.items():
            if meta.get(key) != want:
                raise CheckpointError(
                    f"checkpoint step {step} under {self.dir} is incompatible with this run: its {key!r} "
                    f"differs ({_short(meta.get(key))} vs {_short(want)}){_HINTS.get(key, '')}; use a new out_dir "
                    f"or checkpoint.dir")
        try:
            restored = self.mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))["state"]
        except Exception as e:  # noqa: BLE001 - the metadata matched this run, so the files are damaged
            raise DamagedCheckpoint(f"checkpoint step {step} under {self.dir} could not be restored into this "
                                    f"run's train state (corrupt or incomplete): {e}") from e
        got = jax.tree.structure(restored)
        if got != jax.tree.structure(abstract_state):
            raise CheckpointError(f"checkpoint step {step} under {self.dir} has a different train-state layout")
        return restored, meta

    def restore_latest_good(self, abstract_state, expect_meta: dict, say=print):
        """``(state, meta, step)`` of the newest checkpoint that restores, or ``None`` if there is none.

        A damaged checkpoint is moved aside to ``<dir>/damaged/`` (kept for inspection) and the
        previous one is tried; a checkpoint of another run still raises :class:`CheckpointError`.
        """
        for step in sorted(self.mngr.all_steps(), reverse=True):
            try:
                state, meta = self.restore(step, abstract_state, expect_meta)
                return state, meta, step
            except DamagedCheckpoint as e:
                aside = self.dir / "damaged" / f"{step}-{int(time.time())}"
                aside.parent.mkdir(exist_ok=True)
                (self.dir / str(step)).rename(aside)
                self.mngr.reload()
                say(f"warning: {e}\nwarning: moved it to {aside}; trying the previous checkpoint")
        return None

    def close(self) -> None:
        self.mngr.close()


def write_json_atomic(path: Path, obj) -> None:
    """Write ``obj`` as JSON next to ``path`` and rename it into place (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


_HINTS = {"total_steps": " (the learning-rate schedule is laid out over the total steps; resume with the "
                         "same steps, or start a new out_dir)"}


def _short(x) -> str:
    s = json.dumps(x, sort_keys=True, default=str)
    return s if len(s) < 200 else s[:200] + "..."


def weights_fingerprint(directory, sample: int = 1 << 20) -> str:
    """A cheap fingerprint of the ``*.safetensors`` under ``directory``: each file's name, size
    and its first and last ``sample`` bytes (retrained weights differ there; no full read)."""
    h = hashlib.sha256()
    for f in sorted(Path(directory).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(sample))
            if size > sample:
                fh.seek(max(size - sample, sample))
                h.update(fh.read(sample))
    return h.hexdigest()[:16]
