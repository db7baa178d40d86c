"""A (data=2, fsdp=2, tensor=2) mesh over 8 virtual CPU devices gives the single-device forward."""

import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from kvjax.sharding import logical_to_spec
from paths import ROOT, TESTS  # noqa: F401


@pytest.mark.parametrize("name", ["qwen3-gqa", "llama-mqa-llama3rope"])
def test_sharded_forward_matches_single_device(hf_dir, name):
    folder, _ = hf_dir(name)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    script = os.path.join(TESTS, "sharded_forward.py")
    res = subprocess.run([sys.executable, script, str(folder)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "max_abs_diff" in res.stdout


class FakeMesh:
    shape = {"data": 2, "fsdp": 2, "tensor": 2}


def test_rules_drop_axes_that_do_not_divide():
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (32, 2, 16), FakeMesh()) == P("fsdp", "tensor", None)
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (32, 1, 16), FakeMesh()) == P("fsdp", None, None)
    assert logical_to_spec(("batch", "seq"), (4, 8), FakeMesh()) == P(("data", "fsdp"), None)
    assert logical_to_spec(("batch", "seq"), (2, 8), FakeMesh()) == P("data", None)
    with pytest.raises(ValueError, match="logical axis 'nope' has no sharding rule"):
        logical_to_spec(("nope",), (4,), FakeMesh())
