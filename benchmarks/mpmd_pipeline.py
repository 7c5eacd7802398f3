"""MPMD runtime costs: dispatch overhead per stage execution, and a pipeline against one SPMD jit.

1. Dispatch overhead: a 2-stage pipeline of tiny stages (so compute is
   negligible) with M microbatches; the step time divided by the number of
   executions it makes, against calling one tiny `jax.jit` on a 4-device
   submesh the same number of times, synchronously. Where the time goes: the
   same step's programs and copies recorded once and replayed back to back
   without the runtime ("replay": what any runtime calling these programs
   pays), its programs alone, and the replay on one thread per submesh
   ("threads": whether issuing the submeshes' calls concurrently would beat
   one thread: a call of a tiny program on XLA:CPU returns about when it is
   done, so threads are the only other way a runtime could overlap them).
2. Pipeline vs SPMD: the same MLP stack and train step (adam), as a 2-stage
   1F1B pipeline (4 devices per stage, data parallel inside) and as one
   `jax.jit` data-parallel over all 8 devices (what a user would write
   without stages). Interleaved rounds, best of each.

    python benchmarks/mpmd_pipeline.py [--rounds 5] [--steps 20] [--width 512] [--microbatches 4]

On CPU the simulated devices share two cores, so the pipeline cannot overlap
its stages: the ratio measures the runtime's cost, not a pipeline speed-up.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.jax import build_mesh, ignore_transforms, microbatch, parallelize, task


def mlp_block(w, x):
    return x + jnp.tanh(x @ w["a"]) @ w["b"]


def problem(width: int, layers: int, batch: int, n_mb: int, schedule: str = "1f1b"):
    devs = np.array(jax.devices())
    stages = [task(lambda p, x: _blocks(p, x), f"stage{i}", mesh=build_mesh({"data": 4}, devs[4 * i:4 * i + 4]))
              for i in range(2)]
    tx = optax.adam(1e-3)

    def init():
        keys = iter(jax.random.split(jax.random.key(0), 4 * layers))
        p = [[{"a": jax.random.normal(next(keys), (width, width)) * width ** -0.5,
               "b": jax.random.normal(next(keys), (width, width)) * width ** -0.5} for _ in range(layers)]
             for _ in range(2)]
        return {"p": p, "o": tx.init(p)}

    def get_batch():
        return {"x": jax.random.normal(jax.random.key(1), (batch, width)),
                "y": jax.random.normal(jax.random.key(2), (batch, width))}

    def loss(p, b):
        h = b["x"]
        for s, ps in zip(stages, p):
            h = s(ps, h)
        return jnp.sum((h - b["y"]) ** 2) / b["y"].size * n_mb

    def step(state, b):
        value, grads = jax.value_and_grad(microbatch(loss, 0, batch // n_mb, argnum=1, schedule=schedule))(
            state["p"], b)
        updates, opt = tx.update(grads, state["o"], state["p"])
        return value / n_mb, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    return init, get_batch, step


def _blocks(ps, x):
    for w in ps:
        x = mlp_block(w, x)
    return x


def replay_costs(step, init, get_batch, steps: int) -> tuple[float, float, float, int]:
    """Seconds per execution of one step's programs and copies replayed without the runtime: back to back
    on one thread, back to back without the copies, and on one thread per submesh (each waiting only for
    the calls of other submeshes it reads from); and the number of executions. The calls are recorded
    from one step of the same problem (parameters not donated, so the recorded arguments stay alive)."""
    import multimesh.run.runtime as runtime_module

    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=get_batch)
    state, b = init_p(), get_b()
    calls, move = [], runtime_module.move  # (callable, args, outputs, submesh it runs on)

    def recording_move(xs, targets):
        out = move(xs, targets)
        calls.append((move, (list(xs), list(targets)), out, targets[0].device_set))
        return out

    def recorded(program):
        def call(*args):
            out = program(*args)
            calls.append((program, args, out, out[0].sharding.device_set))
            return out
        return call

    steps_ = fn.runtime._steps
    programs = [s.fn for s in steps_]
    runtime_module.move = recording_move
    for s in steps_:
        s.fn = recorded(s.fn)
    try:
        jax.block_until_ready(fn(state, b))
    finally:
        runtime_module.move = move
        for s, program in zip(steps_, programs):
            s.fn = program
    n = len(steps_)

    def run(only_programs: bool) -> float:
        out = None
        t0 = time.perf_counter()
        for _ in range(steps):
            for f, args, _, _ in calls:
                if only_programs and f is move:
                    continue
                out = f(*args)
            jax.block_until_ready(out)
        return (time.perf_counter() - t0) / steps / n

    made_by = {id(x): i for i, (_, _, out, _) in enumerate(calls) for x in out}
    waits = []  # per call: the calls on other submeshes whose outputs it reads
    lanes: dict[frozenset, list[int]] = {}  # per submesh: its calls, in order
    for i, (f, args, _, where) in enumerate(calls):
        makers = {made_by.get(id(x)) for x in (args[0] if f is move else args)} - {None}
        waits.append(sorted(j for j in makers if calls[j][3] != where))
        lanes.setdefault(frozenset(where), []).append(i)

    def run_concurrently() -> float:
        done = [[threading.Event() for _ in calls] for _ in range(steps)]
        barrier = threading.Barrier(len(lanes))

        def lane(mine: list[int]) -> None:
            for k in range(steps):
                out = None
                for i in mine:
                    for j in waits[i]:
                        done[k][j].wait()
                    f, args, _, _ = calls[i]
                    out = f(*args)
                    done[k][i].set()
                jax.block_until_ready(out)
                barrier.wait()  # steps do not overlap, as in the runtime

        threads = [threading.Thread(target=lane, args=(mine,)) for mine in lanes.values()]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return (time.perf_counter() - t0) / steps / n

    run(False)
    run_concurrently()
    return run(False), run(True), run_concurrently(), n


def timed(fn, state, batch, steps: int):
    loss, state = fn(state, batch)  # warm
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss, state = fn(state, batch)
        jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / steps, state


def spmd_reference(init, get_batch, step):
    """The same step, tasks and microbatching ignored, as one jax.jit data-parallel over 8 devices."""
    mesh = build_mesh({"data": 8})
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def plain(state, b):
        with ignore_transforms():
            return step(state, b)

    state = jax.jit(init, out_shardings=rep)()
    batch = jax.device_put(get_batch(), data)
    fn = jax.jit(plain, in_shardings=(rep, data), out_shardings=(rep, rep), donate_argnums=0)
    return fn, state, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2, help="blocks per stage")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices, jax {jax.__version__}")

    # 1. dispatch overhead: tiny stages, compute negligible
    init, get_batch, step = problem(8, 1, 16, args.microbatches)
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=get_batch, donate=True)
    state, b = init_p(), get_b()
    tiny = jax.jit(lambda x: x + 1.0)  # the floor: one tiny program on a 4-device submesh, like a stage's
    x = jax.device_put(jnp.zeros((8,)), NamedSharding(build_mesh({"data": 4}, jax.devices()[:4]), P("data")))
    per_exec, per_raw, per_replay, per_program, per_concurrent = [], [], [], [], []
    for _ in range(args.rounds):
        t, state = timed(fn, state, b, args.steps)
        n = fn.stats.executions
        per_exec.append(t / n)
        replay, programs, concurrent, _ = replay_costs(step, init, get_batch, args.steps)
        per_replay.append(replay)
        per_program.append(programs)
        per_concurrent.append(concurrent)
        jax.block_until_ready(tiny(x))
        t0 = time.perf_counter()
        for _ in range(n * args.steps):
            jax.block_until_ready(tiny(x))
        per_raw.append((time.perf_counter() - t0) / (n * args.steps))
    raw = min(per_raw)
    print(f"\n1. dispatch: {n} executions and {fn.stats.transfers} transfers per step "
          f"({args.microbatches} microbatches, 2 stages); per stage execution, and its ratio to the raw jit:")
    print(f"   runtime : {min(per_exec) * 1e6:8.1f} us {min(per_exec) / raw:6.2f}  (transfers and bookkeeping included)")
    print(f"   replay  : {min(per_replay) * 1e6:8.1f} us {min(per_replay) / raw:6.2f}  (the same programs and copies, "
          f"back to back, no runtime)")
    print(f"   programs: {min(per_program) * 1e6:8.1f} us {min(per_program) / raw:6.2f}  (the programs alone)")
    print(f"   threads : {min(per_concurrent) * 1e6:8.1f} us {min(per_concurrent) / raw:6.2f}  (the replay on one "
          f"thread per submesh)")
    print(f"   raw jit : {raw * 1e6:8.1f} us {1:6.2f}  (a tiny jitted x + 1 on 4 devices, synchronously)")
    print(f"   runtime / replay: {min(per_exec) / min(per_replay):.2f}")

    # 2. pipeline vs one SPMD jit
    init, get_batch, step = problem(args.width, args.layers, args.batch, args.microbatches)
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=get_batch, donate=True)
    state, b = init_p(), get_b()
    ref, ref_state, ref_b = spmd_reference(init, get_batch, step)
    pipe, spmd = [], []
    for _ in range(args.rounds):
        t, state = timed(fn, state, b, args.steps)
        pipe.append(t)
        t, ref_state = timed(ref, ref_state, ref_b, args.steps)
        spmd.append(t)
    print(f"\n2. step time, width {args.width}, {2 * args.layers} blocks, batch {args.batch}, "
          f"{args.microbatches} microbatches (1F1B)")
    print(f"   2-stage pipeline (4+4 devices): {min(pipe) * 1e3:8.2f} ms")
    print(f"   one SPMD jit (8 devices, DP)  : {min(spmd) * 1e3:8.2f} ms")
    print(f"   ratio pipeline / SPMD         : {min(pipe) / min(spmd):8.2f}")


if __name__ == "__main__":
    main()
