"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8: sharded vs single-device forward."""

import sys

import jax
import numpy as np

import kvjax
from kvjax.sharding import make_mesh

folder = sys.argv[1]
assert len(jax.devices()) == 8, jax.devices()
tokens = np.random.RandomState(0).randint(0, 97, (4, 64))
single = np.asarray(kvjax.forward(kvjax.load_hf(folder), tokens))
mesh = make_mesh(data=2, fsdp=2, tensor=2)
model = kvjax.load_hf(folder, mesh=mesh)
q = model.layers[0].self_attn.q_proj[...]
specs = {str(q.sharding.spec), str(model.layers[0].mlp.down_proj[...].sharding.spec)}
assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape != q.shape, q.sharding
tokens_sharded = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
sharded = np.asarray(kvjax.forward(model, tokens_sharded))
print("max_abs_diff", float(np.abs(sharded - single).max()), "specs", sorted(specs))
assert np.abs(sharded - single).max() <= 1e-5
