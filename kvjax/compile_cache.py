"""JAX's persistent compilation cache for kvjax's command lines.

A long run (a long-context table, a trace run, a scorer fit) is resumable, but each restart
used to compile its programs again: on 2 CPU cores that is minutes before the first record.
Every ``python -m kvjax.<tool>`` / ``eval.py`` / ``train.py`` command therefore keeps compiled
programs in ``$KVJAX_CACHE/jax-compile`` (``~/.cache/kvjax/jax-compile``); a program is found
again when its HLO, the JAX version and the device match, so a stale entry is never used.
``KVJAX_COMPILE_CACHE=off`` turns it off, ``KVJAX_COMPILE_CACHE=DIR`` moves it, and a cache
the user configured for JAX itself (``JAX_COMPILATION_CACHE_DIR``) is left as it is. The
cache holds at most 4 GiB (the least recently used programs are dropped first).
"""

from __future__ import annotations

import os
from pathlib import Path


def enable_compile_cache() -> Path | None:
    """Point JAX's persistent compilation cache at kvjax's folder; returns it (None: off, or
    the user's own JAX setting kept)."""
    import jax

    want = os.environ.get("KVJAX_COMPILE_CACHE", "").strip()
    if want.lower() in ("off", "0", "false", "no"):
        return None
    if jax.config.jax_compilation_cache_dir:         # the user's own choice (env or code)
        return None
    if want:
        folder = Path(want).expanduser()
    else:
        from kvjax.real_model import cache_root

        folder = cache_root() / "jax-compile"
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if jax.config.jax_compilation_cache_max_size in (None, -1):
        # a size cap turns on the cache's file lock: two runs at once (one length each) then
        # never read a half-written entry; the least recently used entries go first
        jax.config.update("jax_compilation_cache_max_size", 4 << 30)
    return folder
