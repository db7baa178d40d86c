"""Typed YAML configs: nested dataclasses from dicts, ``--set a.b=value`` overrides,
and errors that name the unknown or mistyped key by its dotted path.

Relative paths in a config file (string values with a ``/``, e.g. ``assets/testbed-teacher``) are
taken from the current directory; one that does not exist there but does under the config's
*root* -- the folder holding its ``configs/`` folder (the repository), or the config's own folder
when that is not named ``configs`` -- is taken from the root instead, so a shipped config works
from any directory. Paths that exist nowhere yet (a new ``out_dir``) stay relative to the current
directory, and ``--set`` values are taken as typed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


def _check_scalar(tp, value, where: str):
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, str):   # YAML 1.1 reads 1e-3 as a string
        try:
            num = float(value) if tp is float else int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected {tp.__name__}, got str {value!r}") from None
        if tp is float and not math.isfinite(num):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return num
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported field type {tp!r}")


def _convert(tp, value, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {tp}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        _, vt = typing.get_args(tp) or (str, Any)
        return {str(k): _convert(vt, v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    return _check_scalar(tp, value, where)


def from_dict(cls, data: Mapping[str, Any] | None, where: str = ""):
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ConfigError."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    moved = getattr(cls, "MOVED", {})
    if unknown and unknown[0] in moved:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        new = f"{where}.{moved[unknown[0]]}" if where else moved[unknown[0]]
        raise ConfigError(f"config key {key!r} moved to {new!r}")
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown config key {key!r}; known keys here: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, f"{where}.{name}" if where else name)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        key = f"{where}.{missing[0]}" if where else missing[0]
        raise ConfigError(f"config key {key!r} is required")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def to_dict(obj) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``a.b.c=value`` strings (value parsed as YAML) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            if p.isdigit() and isinstance(node, list):
                node = node[int(p)]
                continue
            node = node.setdefault(p, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"--set {key}: {p!r} is not a section")
        last = parts[-1]
        value = yaml.safe_load(raw)
        if last.isdigit() and isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return data


def config_root(path: str | Path) -> Path:
    """The folder a config file's relative paths may be taken from: the parent of its ``configs/``
    folder (the repository root for ``configs/X.yaml``), else the config's own folder."""
    folder = Path(path).resolve().parent
    return folder.parent if folder.name == "configs" else folder


def resolve_paths(data, root: Path, cwd: Path | None = None):
    """``data`` with each relative path string (one with a ``/``) that does not exist under ``cwd``
    (default: the current directory) but does under ``root`` replaced by its path under ``root``."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    if isinstance(data, dict):
        return {k: resolve_paths(v, root, cwd) for k, v in data.items()}
    if isinstance(data, list):
        return [resolve_paths(v, root, cwd) for v in data]
    if (isinstance(data, str) and "/" in data and "\n" not in data and "://" not in data
            and not data.startswith(("/", "~")) and root.resolve() != cwd.resolve()):
        try:
            if not (cwd / data).exists() and (root / data).exists():
                return str(root / data)
        except OSError:             # a name too long for a path, ...: not a path
            pass
    return data


def path_hint(config_path) -> str:
    """The sentence an error about a missing file adds: where relative paths were looked for."""
    here = Path.cwd()
    if config_path is None:
        return f" (relative paths are taken from the current directory, {here})"
    root = config_root(config_path)
    if root.resolve() == here.resolve():
        return f" (relative paths are taken from the current directory, {here})"
    return (f" (a relative path in {config_path} is taken from the current directory, {here}, or, when it is "
            f"not there, from {root}; --set paths from the current directory)")


def load_config(cls, path: str | Path | None, overrides: Sequence[str] = ()):
    """YAML file (optional) + overrides -> dataclass ``cls``. The file's relative paths follow the
    module's rule (:func:`resolve_paths` against :func:`config_root`)."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        data = resolve_paths(data, config_root(p))
    return from_dict(cls, apply_overrides(data, overrides))


def _field_comments(cls) -> dict[str, str]:
    """``{field: the comment on its line}`` from the dataclass's source (empty if unavailable)."""
    import inspect
    import re

    out = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):   # a subclass's comments win
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for line in src.splitlines():
            m = re.match(r"\s+(\w+)\s*:[^#]*?#\s*(.+)$", line)
            if m:
                out[m.group(1)] = m.group(2).strip()
    return out


def describe_keys(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default, meaning)`` of every field of ``cls``, nested sections expanded."""
    hints = typing.get_type_hints(cls)
    notes = _field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows += describe_keys(tp, key + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
            if dataclasses.is_dataclass(default):
                default = to_dict(default)
        else:
            default = "(required)"
        rows.append((key, repr(default) if isinstance(default, str) else str(default), notes.get(f.name, "")))
    return rows


def cli_config(cls, prog: str, doc: str, argv=None, extra=None, *, set_example: str | None = None,
               examples: tuple[str, ...] = ()):
    """Parse ``--config FILE`` and ``--set key=value`` (plus ``extra(parser)`` flags) into
    ``(config of type cls, args)``; a bad config prints ``prog: message`` and exits with 2.
    ``--help`` shows ``--set {set_example}`` (a key of ``cls``) and ``examples``, working
    command lines, at its end."""
    import argparse
    import sys

    epilog = "\n".join(["examples:", *(f"  {c}" for c in examples)]) if examples else None
    ap = argparse.ArgumentParser(prog=prog, description=doc, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (dotted path; --list-keys shows them)"
                         + (f", e.g. --set {set_example}" if set_example else ""))
    ap.add_argument("--list-keys", action="store_true", help="print every config key with its default and meaning")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if args.list_keys:
        rows = describe_keys(cls)
        width = max(len(k) for k, _, _ in rows)
        for key, default, meaning in rows:
            print(f"{key:<{width}}  {default}" + (f"    # {meaning}" if meaning else ""))
        raise SystemExit(0)
    try:
        cfg = load_config(cls, args.config, args.set)
    except (ConfigError, FileNotFoundError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from kvjax.compile_cache import enable_compile_cache

    enable_compile_cache()          # a restarted long run reuses its compiled programs
    return cfg, args
