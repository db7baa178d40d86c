"""Under 8 virtual CPU devices: 5 train steps on a (data=2, fsdp=2, tensor=2) mesh equal
the same steps on one device (losses and parameters)."""

import json
import sys

import jax
import numpy as np

from kvjax.train.loop import train
from train_helpers import tiny_config

out = sys.argv[1]
assert len(jax.devices()) == 8
one = train(tiny_config(f"{out}/one", steps=5, **{"log.every": 1}), quiet=True)
mesh = train(tiny_config(f"{out}/mesh", steps=5, **{"log.every": 1, "mesh.data": 2, "mesh.fsdp": 2,
                                                    "mesh.tensor": 2}), quiet=True)
loss = lambda d: [json.loads(x)["loss"] for x in open(f"{out}/{d}/metrics.jsonl")]  # noqa: E731
dl = np.abs(np.array(loss("one")) - np.array(loss("mesh"))).max()
dp = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
         for a, b in zip(jax.tree.leaves(one["params_tree"]), jax.tree.leaves(mesh["params_tree"])))
w = jax.tree.leaves(mesh["params_tree"])
sharded = sum(len({str(s.index) for s in x.addressable_shards}) > 1 for x in w)
print(json.dumps({"max_loss_diff": float(dl), "max_param_diff": dp, "sharded_leaves": sharded}))
assert dl <= 1e-5 and dp <= 1e-5 and sharded > 0
