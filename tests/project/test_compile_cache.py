"""Every kvjax command line keeps JAX's compiled programs in ``$KVJAX_CACHE/jax-compile``
unless turned off or moved, and leaves a cache the user set for JAX itself alone."""

import os
import subprocess
import sys

import pytest

PROBE = ("from kvjax.configio import cli_config\n"
         "from kvjax.longctx.run import LongCtxConfig\n"
         "import jax\n"
         "cli_config(LongCtxConfig, 'probe', '', ['--set', 'problems=1'])\n"
         "print(jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size)\n")


def _probe(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "KVJAX_"))}
    res = subprocess.run([sys.executable, "-c", PROBE], env={**base, "KVJAX_CACHE": str(tmp_path / "kc"), **env},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()


def test_default_is_the_kvjax_cache_folder_with_a_size_cap(tmp_path):
    folder, cap = _probe(tmp_path)
    assert folder == str(tmp_path / "kc" / "jax-compile") and os.path.isdir(folder)
    assert int(cap) == 4 << 30


@pytest.mark.integration        # three subprocesses: make test, not the test-fast loop
def test_off_moved_and_the_users_own_setting(tmp_path):
    assert _probe(tmp_path, KVJAX_COMPILE_CACHE="off")[0] == "None"
    assert _probe(tmp_path, KVJAX_COMPILE_CACHE=str(tmp_path / "elsewhere"))[0] == str(tmp_path / "elsewhere")
    assert _probe(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine"))[0] == str(tmp_path / "mine")
    assert not (tmp_path / "kc").exists()
