#!/usr/bin/env bash
# Create .venv-kvpress (repo root): NVIDIA kvpress 0.5.5 for the side-by-side comparison with kvjax
# (experiments/kvpress_compare.py runs inside it; it never imports kvjax or jax, and kvjax's .venv is not
# touched).
#
#   bash experiments/kvpress_venv.sh            # no-op when .venv-kvpress exists and imports kvpress 0.5.5
#
# Pins: kvpress==0.5.5 (which requires transformers>=4.56,<5.3) and transformers 5.2.0, the newest
# release it accepts. Not 4.x: the local SmolLM2 folder's config.json is written in the transformers-5
# form ("rope_parameters": {"rope_theta": 100000}); transformers 4.x ignores that key and silently
# falls back to rope_theta=10000, i.e. a different model. torch is the local CPU wheel
# (/opt/wheels/torch-2.13.0+cpu...), pinned so that pip never fetches a CUDA build from the index.
# Only packages are downloaded, never model weights.
#
# Environment overrides: KVPRESS_VENV (path, default <repo>/.venv-kvpress), PYTHON (default python3,
# must be 3.11 for the cp311 torch wheel), KVPRESS_TRANSFORMERS (default 5.2.0), TORCH_WHEEL.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVPRESS_VENV:-$ROOT/.venv-kvpress}"
PYTHON="${PYTHON:-python3}"
KVPRESS_VERSION="0.5.5"
TRANSFORMERS_VERSION="${KVPRESS_TRANSFORMERS:-5.2.0}"
WHEEL_DIR="/opt/wheels"
TORCH_WHEEL="${TORCH_WHEEL:-$WHEEL_DIR/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"

die() { echo "kvpress_venv.sh: error: $*" >&2; exit 1; }

check() {   # 0 when the venv's python imports kvpress at the pinned version
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$KVPRESS_VERSION" <<'EOF' >/dev/null 2>&1
import sys, importlib.metadata as md
import kvpress  # noqa: F401  (also imports torch and transformers)
sys.exit(0 if md.version("kvpress") == sys.argv[1] else 1)
EOF
}

if check; then
    echo "kvpress_venv.sh: $VENV already imports kvpress $KVPRESS_VERSION; nothing to do."
    exit 0
fi

# ---- preconditions, each with its own message -------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "'$PYTHON' not found (set PYTHON=/path/to/python3.11)."
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$PYVER" = "3.11" ] || die "$PYTHON is Python $PYVER; the torch wheel $TORCH_WHEEL is cp311 (set PYTHON to a 3.11 interpreter)."
[ -f "$TORCH_WHEEL" ] || die "torch wheel not found: $TORCH_WHEEL (set TORCH_WHEEL=...)."
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || die "$PYTHON lacks the venv/ensurepip modules (install python3.11-venv)."

# ---- create (or repair) the venv --------------------------------------------------------------
if [ -e "$VENV" ] && [ ! -x "$VENV/bin/python" ]; then
    die "$VENV exists but has no bin/python; remove it (rm -rf '$VENV') and rerun."
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "kvpress_venv.sh: creating $VENV with $PYTHON ($PYVER)"
    "$PYTHON" -m venv "$VENV" || die "python -m venv $VENV failed."
else
    echo "kvpress_venv.sh: $VENV exists but does not import kvpress $KVPRESS_VERSION; (re)installing into it."
fi

# torch's local-version pin ("+cpu") keeps the resolver on the local wheel even when the index has
# newer torch builds.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
printf 'torch==2.13.0+cpu\n' >"$CONSTRAINTS"

PIP=("$VENV/bin/python" -m pip)
# this machine's pip config lists local file:// indexes that lack most projects; hide that noise
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
quiet_pip install --quiet --upgrade pip \
    || die "upgrading pip in $VENV failed (is the package index reachable?)."
echo "kvpress_venv.sh: installing torch (local wheel), kvpress==$KVPRESS_VERSION, transformers==$TRANSFORMERS_VERSION"
quiet_pip install --quiet --find-links "$WHEEL_DIR" -c "$CONSTRAINTS" \
    "$TORCH_WHEEL" "kvpress==$KVPRESS_VERSION" "transformers==$TRANSFORMERS_VERSION" \
    || die "pip install failed (see above). kvpress $KVPRESS_VERSION needs transformers>=4.56,<5.3 and torch>=2.3.1,<3; the index must be reachable for kvpress and its dependencies."

if ! check; then
    "$VENV/bin/python" -c 'import kvpress' || true   # show the import error
    die "$VENV was installed but does not import kvpress $KVPRESS_VERSION (see the traceback above)."
fi
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
print("kvpress_venv.sh: ready:", ", ".join(f"{p} {md.version(p)}" for p in ("kvpress", "transformers", "torch")))
EOF
