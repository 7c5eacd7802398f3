"""One process of a multi-process pipeline test (started by tests/test_multiprocess.py).

    python tests/mp_worker.py SCENARIO PROCESS_ID NUM_PROCESSES COORDINATOR_PORT DEVICES_PER_PROCESS [OUT_DIR]

For each schedule of ``MP_SCHEDULE`` (comma-separated, default 1f1b; one launch
and one compile per schedule), runs a pipelined train step (2 stages, or one per
process; interleaved: 2 chunks per stage; 4 microbatches, adam) for 3 steps with
stages placed as SCENARIO says, and the same step on one local device; checks on
this process the loss of every step and the parameter shards it holds against
the one-device run, that the executed order is the schedule's and that the peak
live activations are its bound, and prints one JSON line with what it saw
(``runs``: one entry per schedule, in order).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

SCENARIO, PID, NPROC, PORT, PER = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
OUT = sys.argv[6] if len(sys.argv) > 6 else None  # save the final state there (with reference.npz)
RESTORE = os.environ.get("MP_RESTORE")  # start from the latest checkpoint there instead of init
# Compiling is most of a worker's time (each process compiles every stage's programs, its own and the
# others'): XLA's cheapest CPU code generation halves it. The one-device reference is compiled the same way;
# what these tests check (plans, transfers, orders, values against the reference) does not depend on it.
os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={PER} --xla_backend_optimization_level=0 "
                           "--xla_llvm_disable_expensive_passes=true")
os.environ["JAX_PLATFORMS"] = "cpu"
STARTED = time.perf_counter()

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

COMPILE_SECONDS = [0.0]  # XLA's compile time so far in this process (reported per schedule: what a run costs)
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **_: COMPILE_SECONDS.__setitem__(0, COMPILE_SECONDS[0] + secs)
    if name == "/jax/core/compile/backend_compile_duration" else None)

B, D, H, N_MB = 16, 16, 32, 4
STEPS = int(os.environ.get("MP_STEPS", "3"))  # the failure test runs long and kills a process mid-run
TX = optax.adam(1e-2)
SCHEDULES = os.environ.get("MP_SCHEDULE", "1f1b").split(",")
if (OUT or RESTORE) and len(SCHEDULES) > 1:
    raise SystemExit(f"MP_SCHEDULE={','.join(SCHEDULES)}: saving or restoring a checkpoint takes one schedule")


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


def batch():
    return {"x": jax.random.normal(jax.random.key(5), (B, D)), "y": jax.random.normal(jax.random.key(6), (B, D))}


def pipeline(schedule: str):
    """``(step, init, logical stages)`` of the pipelined train step under ``schedule`` (interleaved: every device group
    runs two logical stages, logical stage l on group l % groups)."""
    meshes = [Mesh(np.array(ds), ("model",)) for ds in stage_devices()]
    stages = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    options = {}
    if schedule == "interleaved":
        stages, options = stages + stages, {"interleave": 2}

    def init():
        keys = jax.random.split(jax.random.key(0), 2 * len(stages))
        p = {f"s{i}": {"a": jax.random.normal(keys[2 * i], (D, H)) * .2,
                       "b": jax.random.normal(keys[2 * i + 1], (H, D)) * .2} for i in range(len(stages))}
        return {"p": p, "o": TX.init(p)}

    def loss(p, b):
        h = b["x"]
        for i, s in enumerate(stages):
            h = s(p[f"s{i}"], h)
        return jnp.sum((h - b["y"]) ** 2) / (B * D)

    def step(state, b):
        pipelined = microbatch(loss, 0, B // N_MB, argnum=1, schedule=schedule, **options)
        value, grads = jax.value_and_grad(pipelined)(state["p"], b)
        updates, opt = TX.update(grads, state["o"], state["p"])
        return value, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    return step, init, len(stages)


def held_shards_match(got, want) -> int:
    """Compare every shard of ``got`` this process holds with the same slice of ``want``; count them."""
    n = 0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        for shard in g.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(w)[shard.index], rtol=2e-5, atol=1e-6)
            n += 1
    return n


def one_device(step, start) -> Iterator[tuple[float, Any]]:
    """The reference: ``step`` without its transforms on one local device from ``start()``; (loss, state)
    after each step, for as many steps as asked."""
    local = jax.local_devices()[0]

    def reference(state, b):
        with ignore_transforms():
            return step(state, b)

    with jax.default_device(local):
        ref, b, state = jax.jit(reference), jax.jit(batch)(), start()
    while True:
        with jax.default_device(local):
            value, state = ref(state, b)
        yield float(value), state


# stages -> [(loss, state) after each step] of the one-device run: it does not depend on the schedule, so
# schedules with as many stages reuse it (kept only when several schedules run in this process)
REFERENCE: dict[int, list[tuple[float, Any]]] = {}


def _per_stage(actions: list[str], schedule: Any) -> dict[int, list[str]]:
    """Actions such as ``F[s2,m0,c1]`` by the device group of their logical stage."""
    out: dict[int, list[str]] = {}
    for a in actions:
        out.setdefault(int(a.split("[s")[1].split(",")[0]) % schedule.num_stages, []).append(a)
    return out


def run(schedule: str) -> dict:
    """``STEPS`` steps of the pipeline under ``schedule`` against one local device; what was seen."""
    started, compiled = time.perf_counter(), COMPILE_SECONDS[0]
    step, init, n_stages = pipeline(schedule)
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=batch)
    built = time.perf_counter()
    b = get_b()
    if RESTORE:  # resume a checkpoint (written by one process) on this pipeline; the reference starts from its values
        import multimesh.checkpoint as ckpt

        with ckpt.CheckpointManager(RESTORE) as mgr:
            state = mgr.restore(target=fn.abstract_params).state
        saved = np.load(os.path.join(RESTORE, "reference.npz"))
        references = one_device(step, lambda: jax.tree.unflatten(
            jax.tree.structure(fn.abstract_params), [jnp.asarray(saved[f"arr_{i}"]) for i in range(len(saved.files))]))
    else:
        state = init_p()
        cached = REFERENCE.get(n_stages)
        references = iter(cached) if cached is not None else one_device(step, jax.jit(init))
        if cached is None and len(SCHEDULES) > 1:
            REFERENCE[n_stages] = cached = []
            references = (cached.append(r) or r for r in references)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        value, state = fn(state, b)
        ref_value, ref_state = next(references)
        losses.append(float(value))  # readable on every process
        if len(losses) == 1:
            first_step = time.perf_counter()
        print(f"step {len(losses)}", flush=True)
        ref_losses.append(ref_value)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, err_msg=f"schedule {schedule}: losses")
    shards = held_shards_match(state, ref_state)
    mine = set(jax.local_devices())
    stage_of_leaf = {i: sorted({d.process_index for d in leaf.sharding.device_set})
                     for i, leaf in enumerate(jax.tree.leaves(state["p"]))}
    held = sorted({i for i, leaf in enumerate(jax.tree.leaves(state["p"])) if leaf.sharding.device_set & mine})
    plan_schedule = fn.plan.schedule
    executed = [label.split(":", 1)[1] for label in fn.stats.executed if any(f":{k}[" in label for k in "FBW")]
    expected = [str(a) for a in plan_schedule.order]
    if "W" in "".join(expected):  # zero-bubble: stage 0 needs no input gradient, its B is dropped
        expected = [str(a) for a in plan_schedule.order if not (a.kind == "B" and a.stage == 0)]
    if fn.runtime.group_actions > 1:  # a group runs other stages' actions after it: each stage's order holds
        executed, expected = _per_stage(executed, plan_schedule), _per_stage(expected, plan_schedule)
    assert executed == expected, (schedule, executed, expected)
    assert fn.stats.peak_live_activations == plan_schedule.peak_live_activations, (
        schedule, fn.stats.peak_live_activations, plan_schedule.peak_live_activations)
    if OUT:  # every process writes the shards it holds; the test restores them in one process
        import multimesh.checkpoint as ckpt

        with ckpt.CheckpointManager(OUT) as mgr:
            mgr.save(STEPS, state)
        if PID == 0:
            np.savez(os.path.join(OUT, "reference.npz"), *[np.asarray(x) for x in jax.tree.leaves(ref_state)])
    return {"schedule": plan_schedule.name, "peak_live": fn.stats.peak_live_activations,
            "bound": plan_schedule.peak_live_activations, "actions": len(executed), "losses": losses,
            "reference": ref_losses, "shards_checked": shards, "leaf_processes": stage_of_leaf,
            "held_param_leaves": held, "executions": fn.stats.executions, "transfers": fn.stats.transfers,
            "dispatches": fn.stats.dispatches,
            "seconds": round(time.perf_counter() - started, 2), "build_seconds": round(built - started, 2),
            "compile_seconds": round(COMPILE_SECONDS[0] - compiled, 2),
            "first_step_seconds": round(first_step - built, 2)}


runs = [run(s) for s in SCHEDULES]
print(json.dumps({"process": PID, "runs": runs, "seconds": round(time.perf_counter() - STARTED, 2)}), flush=True)
jax.distributed.shutdown()
