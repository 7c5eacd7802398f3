"""One process of a multi-process pipeline test (started by tests/test_multiprocess.py).

    python tests/mp_worker.py SCENARIO PROCESS_ID NUM_PROCESSES COORDINATOR_PORT DEVICES_PER_PROCESS [OUT_DIR]

Runs a pipelined train step (2 stages, or one per process; 4 microbatches,
adam) for 3 steps with stages placed as SCENARIO says, and the same step on one local device; checks
on this process the loss of every step and the parameter shards it holds
against the one-device run, and prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import sys

SCENARIO, PID, NPROC, PORT, PER = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
OUT = sys.argv[6] if len(sys.argv) > 6 else None  # save the final state there (with reference.npz)
RESTORE = os.environ.get("MP_RESTORE")  # start from the latest checkpoint there instead of init
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={PER}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import multimesh.distributed
from multimesh.jax import (
    ignore_transforms,
    microbatch,
    parallelize,
    task,
    with_sharding_constraint,
)

if os.environ.get("MP_PLAIN_JAX_INIT"):  # the documented alternative: JAX's own start, two flags set first
    transfer_port = multimesh.distributed.reserve_port()  # held until JAX binds it (why: there)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{transfer_port}")
    jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=NPROC, process_id=PID)
else:
    multimesh.distributed.initialize(f"127.0.0.1:{PORT}", NPROC, PID, heartbeat_timeout_seconds=10)

B, D, H, N_MB = 16, 16, 32, 4
STEPS = int(os.environ.get("MP_STEPS", "3"))  # the failure test runs long and kills a process mid-run
TX = optax.adam(1e-2)
SCHEDULE = os.environ.get("MP_SCHEDULE", "1f1b")


def stage_devices() -> list[list]:
    """The two stages' devices: one process each, or each stage on every process (half its devices)."""
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(NPROC)]
    if SCENARIO == "one_stage_per_process":
        return by_process
    if SCENARIO == "uneven_stages":  # device counts differ: values cross through whole copies
        return [by_process[0], by_process[1][:1]]
    if SCENARIO == "stages_span_processes":
        half = PER // 2
        return [[d for ds in by_process for d in ds[:half]], [d for ds in by_process for d in ds[half:]]]
    raise SystemExit(f"unknown scenario {SCENARIO}")


def layer(w, x):
    h = with_sharding_constraint(jnp.tanh(x @ w["a"]), P(None, "model"))
    return x + h @ w["b"]


def init():
    keys = jax.random.split(jax.random.key(0), 2 * len(meshes))
    p = {f"s{i}": {"a": jax.random.normal(keys[2 * i], (D, H)) * .2,
                   "b": jax.random.normal(keys[2 * i + 1], (H, D)) * .2} for i in range(len(meshes))}
    return {"p": p, "o": TX.init(p)}


def batch():
    return {"x": jax.random.normal(jax.random.key(5), (B, D)), "y": jax.random.normal(jax.random.key(6), (B, D))}


meshes = [Mesh(np.array(ds), ("model",)) for ds in stage_devices()]
stages = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
MB_OPTIONS = {}
if SCHEDULE == "interleaved":  # two chunks per device group: logical stage l runs on group l % 2
    stages, MB_OPTIONS = stages + stages, {"interleave": 2}
    meshes = meshes + meshes


def loss(p, b):
    h = b["x"]
    for i, s in enumerate(stages):
        h = s(p[f"s{i}"], h)
    return jnp.sum((h - b["y"]) ** 2) / (B * D)


def step(state, b):
    value, grads = jax.value_and_grad(microbatch(loss, 0, B // N_MB, argnum=1, schedule=SCHEDULE, **MB_OPTIONS))(state["p"], b)
    updates, opt = TX.update(grads, state["o"], state["p"])
    return value, {"p": optax.apply_updates(state["p"], updates), "o": opt}


def reference(state, b):
    with ignore_transforms():
        return step(state, b)


def held_shards_match(got, want) -> int:
    """Compare every shard of ``got`` this process holds with the same slice of ``want``; count them."""
    n = 0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        for shard in g.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(w)[shard.index], rtol=2e-5, atol=1e-6)
            n += 1
    return n


fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=batch)
b = get_b()
local = jax.local_devices()[0]
with jax.default_device(local):
    ref_b, ref = jax.jit(batch)(), jax.jit(reference)
    if RESTORE:  # resume a checkpoint (written by one process) on this pipeline; the reference starts from its values
        import multimesh.checkpoint as ckpt

        with ckpt.CheckpointManager(RESTORE) as mgr:
            state = mgr.restore(target=fn.abstract_params).state
        saved = np.load(os.path.join(RESTORE, "reference.npz"))
        ref_state = jax.tree.unflatten(jax.tree.structure(fn.abstract_params),
                                       [jnp.asarray(saved[f"arr_{i}"]) for i in range(len(saved.files))])
    else:
        state, ref_state = init_p(), jax.jit(init)()
losses, ref_losses = [], []
for _ in range(STEPS):
    value, state = fn(state, b)
    with jax.default_device(local):
        ref_value, ref_state = ref(ref_state, ref_b)
    losses.append(float(value))  # readable on every process
    print(f"step {len(losses)}", flush=True)
    ref_losses.append(float(ref_value))
np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
shards = held_shards_match(state, ref_state)
mine = {d for d in jax.local_devices()}
stage_of_leaf = {i: sorted({d.process_index for d in leaf.sharding.device_set})
                 for i, leaf in enumerate(jax.tree.leaves(state["p"]))}
held = sorted({i for i, leaf in enumerate(jax.tree.leaves(state["p"])) if leaf.sharding.device_set & mine})
schedule = fn.plan.schedule
executed = [label.split(":", 1)[1] for label in fn.stats.executed if any(f":{k}[" in label for k in "FBW")]
expected = [str(a) for a in schedule.order]
if "W" in "".join(expected):  # zero-bubble: stage 0 needs no input gradient, its B is dropped
    expected = [str(a) for a in schedule.order if not (a.kind == "B" and a.stage == 0)]
assert executed == expected, (executed, expected)
assert fn.stats.peak_live_activations == schedule.peak_live_activations, (
    fn.stats.peak_live_activations, schedule.peak_live_activations)
if OUT:  # every process writes the shards it holds; the test restores them in one process
    import multimesh.checkpoint as ckpt

    with ckpt.CheckpointManager(OUT) as mgr:
        mgr.save(STEPS, state)
    if PID == 0:
        np.savez(os.path.join(OUT, "reference.npz"), *[np.asarray(x) for x in jax.tree.leaves(ref_state)])
print(json.dumps({"process": PID, "schedule": schedule.name, "peak_live": fn.stats.peak_live_activations, "losses": losses, "reference": ref_losses, "shards_checked": shards,
                  "leaf_processes": stage_of_leaf, "held_param_leaves": held,
                  "executions": fn.stats.executions, "transfers": fn.stats.transfers}), flush=True)
jax.distributed.shutdown()
