"""One process of the multi-process split-stack test (started by tests/test_scan_split.py).

    python tests/mp_scan_worker.py PROCESS_ID COORDINATOR_PORT

Two processes of 4 CPU devices each, one pipeline stage per process: the ``nn.scan`` stack of
tests/test_scan_split.py split 2+2, 1F1B over 4 microbatches, 3 Adam steps. Checks, on this process,
every loss and every shard it holds against the same step on one of its devices, and that it holds
shards of its own stage's layers only; prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

PID, PORT = int(sys.argv[1]), int(sys.argv[2])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np

import multimesh.distributed

multimesh.distributed.initialize(f"127.0.0.1:{PORT}", 2, PID, heartbeat_timeout_seconds=10)

from test_scan_split import LAYERS, Net, get_batch, ignore_transforms, init_for, make_step, parallelize, \
    register_stages, stacked  # noqa: E402

model = Net()
register_stages(2, (2, 2), ("data", "model"))  # stage s: jax.devices()[4s:4s+4], the devices of process s
fn, init_fn, batch_fn = parallelize(make_step(model), init_params=init_for(model), get_input_batch=get_batch)
state, batch = init_fn(), batch_fn()
step = make_step(model)


def reference(s, b):
    with ignore_transforms():
        return step(s, b)


local = jax.local_devices()[0]
with jax.default_device(local):
    ref_state, ref_batch, ref = jax.jit(init_for(model))(), jax.jit(get_batch)(), jax.jit(reference)
losses = []
for _ in range(3):
    value, state = fn(state, batch)
    with jax.default_device(local):
        ref_value, ref_state = ref(ref_state, ref_batch)
    losses.append(float(value))  # readable on every process
    np.testing.assert_allclose(losses[-1], float(ref_value), rtol=1e-5)
shards = 0
for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    for shard in got.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], rtol=1e-5, atol=1e-6)
        shards += 1
layers_here = set()
for x in stacked(state).values():
    for shard in x.addressable_shards:
        layers_here.update(range(*shard.index[0].indices(LAYERS)))
print(json.dumps({"process": PID, "losses": losses, "shards_checked": shards, "layers": sorted(layers_here)}),
      flush=True)
jax.distributed.shutdown()
