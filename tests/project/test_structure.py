"""The package's shape: self-contained kernels, no import cycles, small files."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvjax", "pallas_kernels")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module ``name`` imports, at module level or inside a function: ``from a
    import b`` counts ``a.b`` when it is a module, else ``a``."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_import_cycles():
    """No module reaches itself through imports, deferred (function-level) imports included."""
    modules = _modules()
    graph = {n: _imports(n, p, modules) for n, p in modules.items()}
    assert _cycle(graph) is None, "import cycle: " + " -> ".join(_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_pallas_kernels_imports_nothing_from_kvjax():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("pallas_kernels"):
            bad = {m for m in _imports(name, path, modules) if m.split(".")[0] == "kvjax"}
            assert not bad, f"{name} imports {sorted(bad)}"
    code = ("import sys, pallas_kernels, pallas_kernels.reference, pallas_kernels.keep_rule, pallas_kernels.tpu, "
            "pallas_kernels.gpu; print(sorted(m for m in sys.modules if m.split('.')[0] == 'kvjax'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"


def test_no_file_over_400_lines():
    files = [f for d in (*PACKAGES, "tests", "bench", "experiments") for f in (ROOT / d).rglob("*.py")]
    files += [ROOT / "eval.py", ROOT / "train.py"]
    long = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > 400}
    assert not long, f"files over 400 lines: {long}"
