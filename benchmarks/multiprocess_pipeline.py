"""Real concurrency: a 2-stage pipeline on 2 processes, each pinned to its own core.

Simulated devices in one process share its threads; processes run on
different cores at once. Measured in one run:

- single: one process pinned to core 0, one CPU device, the whole model's
  train step as one `jax.jit` (no pipeline): the obvious alternative;
- pipeline: 2 processes (`multimesh.distributed`), process i pinned to core i
  with one CPU device, one stage each, ``--microbatches`` (8), ``--schedule``
  (1f1b; also gpipe, interleaved with ``--interleave`` chunks per stage, zb-h1,
  zb-h2).

Printed: tokens/s of both, their ratio, and the efficiency against the
schedule's ideal speed-up ``stages * (1 - bubble)``, the median over
``--rounds`` rounds of ``--steps`` steps; the peak live activations measured
per stage against the schedule's bound; the final losses. The model is a stack
of per-token MLP blocks (``--layers`` blocks of ``--width`` x 4``--width``),
half of them on each stage (interleaved: ``2 x interleave`` groups, dealt to the
stages in turn); adam. ``--sweep`` runs every schedule at 4, 8 and 16
microbatches, one row each. ``--profile`` also prints, per process, where one
more step's time went (`pipeline_profile.py`: compute per action, waits for the
other process, sends, the runtime's own time).

    python benchmarks/multiprocess_pipeline.py [--schedule zb-h2] [--microbatches 8] [--sweep] [--profile]
        [--steps 10] [--rounds 5] [--layers 8] [--width 512] [--batch 64] [--seq 32]

Needs 2 free cores (``taskset``); the numbers mean little on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")


def block(ps: list, h):
    """Per-token MLP blocks with residuals: one stage's work."""
    import jax.numpy as jnp

    for p in ps:
        h = h + jnp.tanh(h @ p["a"]) @ p["b"]
    return h


def model(args: argparse.Namespace, stages: list | None):
    """``(init, step)``: the train step, its blocks split over ``stages`` tasks (None: one device, no tasks)."""
    import jax
    import jax.numpy as jnp
    import optax

    from multimesh.jax import microbatch

    tx, w = optax.adam(1e-3), args.width

    def init():
        keys = jax.random.split(jax.random.key(0), 2 * args.layers)
        return {"p": [{"a": jax.random.normal(keys[2 * i], (w, 4 * w)) * w ** -.5,
                       "b": jax.random.normal(keys[2 * i + 1], (4 * w, w)) * (4 * w) ** -.5}
                      for i in range(args.layers)]}

    chunks = args.interleave if args.schedule == "interleaved" else 1
    groups = 2 * chunks  # group g runs on stage g % 2: stages visited in turn, `chunks` times per microbatch
    per = args.layers // groups
    parts = [block] * groups if stages is None else [stages[g % 2] for g in range(groups)]

    def loss(ps, batch):
        h = batch["x"]
        for g, part in enumerate(parts):
            h = part(ps[g * per:(g + 1) * per], h)
        return jnp.mean((h - batch["y"]) ** 2) / args.microbatches

    def state_init():
        p = init()["p"]
        return {"p": p, "o": tx.init(p)}

    def step(state, batch):
        if stages is None:
            value, grads = jax.value_and_grad(lambda p, b: loss(p, b) * args.microbatches)(state["p"], batch)
        else:
            mb = args.batch // args.microbatches
            kw = {"interleave": chunks} if args.schedule == "interleaved" else {}
            pipelined = microbatch(loss, 0, mb, argnum=1, schedule=args.schedule, **kw)
            value, grads = jax.value_and_grad(pipelined)(state["p"], batch)
        updates, opt = tx.update(grads, state["o"], state["p"])
        return value, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    return state_init, step


def batch(args: argparse.Namespace):
    import jax

    kx, ky = jax.random.split(jax.random.key(1))
    shape = (args.batch, args.seq, args.width)
    return {"x": jax.random.normal(kx, shape), "y": jax.random.normal(ky, shape)}


def timed(step, state, b, steps: int, rounds: int) -> tuple[float, float, object]:
    """Seconds per step (the median over ``rounds`` rounds of ``steps`` steps) after 3 warm-up steps; the
    loss of the first step (equal for every schedule: the same initial state); the state after them."""
    import jax

    value, state = step(state, b)
    first = float(value)
    for _ in range(2):
        value, state = step(state, b)
    float(value)
    per_round = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            value, state = step(state, b)
        float(value)
        jax.block_until_ready(state)
        per_round.append((time.perf_counter() - start) / steps)
    return statistics.median(per_round), first, state


def single(args: argparse.Namespace) -> dict:
    import jax

    init, step = model(args, None)
    seconds, loss, _ = timed(jax.jit(step), jax.jit(init)(), jax.jit(lambda: batch(args))(), args.steps, args.rounds)
    return {"seconds": seconds, "loss": loss}


def worker(args: argparse.Namespace) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import multimesh.distributed
    from multimesh.jax import parallelize, task

    multimesh.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.process)
    meshes = [Mesh(np.array([d for d in jax.devices() if d.process_index == p]), ("x",)) for p in range(2)]
    stages = [task(block, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    init, step = model(args, stages)
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=lambda: batch(args))
    b = get_b()
    seconds, loss, state = timed(fn, init_p(), b, args.steps, args.rounds)
    schedule = fn.plan.schedule
    out = {"seconds": seconds, "loss": loss, "bubble": schedule.bubble_fraction,
           "peak": {str(k): v for k, v in fn.stats.peak_live_activations.items()},
           "bound": {str(k): v for k, v in schedule.peak_live_activations.items()}}
    if args.profile:
        from pipeline_profile import profile_step  # this script's folder is on sys.path

        (_, state), _ = profile_step(fn, state, b)  # the first profiled call pays for the wrappers' first use
        _, out["profile"] = profile_step(fn, state, b)
    jax.distributed.shutdown()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(core: int) -> list[str]:
    """The command prefix that keeps a process on its own core (``taskset -c CORE``, where there is one)."""
    return ["taskset", "-c", str(core)] if shutil.which("taskset") else []


def one_device_env(**extra: str) -> dict[str, str]:
    """This environment for a process with one CPU device and no compilation cache (every run compiles:
    the same for all), plus ``extra``."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu", **extra)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def launch(args: argparse.Namespace, role: list[str], core: int) -> subprocess.Popen:
    env = one_device_env()
    cmd = [*pinned(core), sys.executable, __file__, *role, "--steps", str(args.steps), "--layers", str(args.layers),
           "--width", str(args.width), "--batch", str(args.batch), "--seq", str(args.seq),
           "--microbatches", str(args.microbatches), "--schedule", args.schedule, "--interleave",
           str(args.interleave), "--rounds", str(args.rounds), *(["--profile"] if args.profile else [])]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def result(p: subprocess.Popen, timeout: float = 900) -> dict:
    out, _ = p.communicate(timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"a benchmark process failed ({p.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def pipelined(args: argparse.Namespace) -> dict:
    """One configuration on 2 processes, each on its own core."""
    port = free_port()
    procs = [launch(args, ["--process", str(i), "--port", str(port)], i) for i in range(2)]
    two = [result(p) for p in procs]
    if args.profile:
        print_profiles(args, [t["profile"] for t in two], [t["seconds"] for t in two])
    return {"seconds": max(t["seconds"] for t in two), "loss": two[0]["loss"], "bubble": two[0]["bubble"],
            "peak": {**two[0]["peak"], **two[1]["peak"]}, "bound": two[0]["bound"]}


def print_profiles(args: argparse.Namespace, profiles: list[dict], unprofiled: list[float]) -> None:
    """Per process: where one profiled step's time went (see pipeline_profile.py), against its wall time."""
    from pipeline_profile import CATEGORIES

    name = f"{args.schedule} x{args.interleave}" if args.schedule == "interleaved" else args.schedule
    print(f"profile of one step, {name}, {args.microbatches} microbatches (seconds, share of the profiled step; "
          f"n: calls)")
    for i, (p, plain) in enumerate(zip(profiles, unprofiled)):
        parts = ", ".join(f"{k} {p['seconds'][k]:.3f} ({p['seconds'][k] / p['wall']:.0%}, n {p['counts'][k]})"
                          for k in CATEGORIES if p["counts"][k] or k == "runtime")
        print(f"  process {i}: profiled step {p['wall']:.3f} s (unprofiled {plain:.3f} s/step): {parts}")
        order = " ".join(f"{label.split(':', 1)[-1]}={sec * 1e3:.0f}ms" for label, sec in p["actions"])
        print(f"    its programs in order: {order}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--interleave", type=int, default=2, help="chunks per stage (interleaved)")
    parser.add_argument("--sweep", action="store_true", help="every schedule at 4, 8 and 16 microbatches")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step per process: compute per action, waits for the other process, "
                             "sends, the runtime's own time (benchmarks/pipeline_profile.py)")
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        print(json.dumps(single(args)))
        return
    if args.process is not None:
        print(json.dumps(worker(args)))
        return

    one = result(launch(args, ["--single"], 0))
    tokens = args.batch * args.seq
    rate_one = tokens / one["seconds"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"model: {args.layers} blocks of {args.width}x{4 * args.width}, batch {args.batch} x {args.seq} tokens, "
          f"median of {args.rounds} rounds of {args.steps} steps, {os.cpu_count()} cores, load average {load:.2f}")
    print(f"1 process, 1 core, 1 device (jit): {one['seconds']:.3f} s/step, {rate_one:.0f} tokens/s, "
          f"first loss {one['loss']:.6f}")
    print(f"{'schedule':>14} {'mb':>3} {'s/step':>7} {'speed-up':>8} {'ideal':>6} {'effic.':>6} "
          f"{'peak act. (bound)':>18} {'first loss':>10}")
    configs = [(s, m) for s in SCHEDULES for m in (4, 8, 16)] if args.sweep else [(args.schedule, args.microbatches)]
    for schedule, mb in configs:
        run = argparse.Namespace(**{**vars(args), "schedule": schedule, "microbatches": mb})
        two = pipelined(run)
        speedup, ideal = one["seconds"] / two["seconds"], 2 * (1 - two["bubble"])
        peak = " ".join(f"{two['peak'].get(k, '?')}({v})" for k, v in sorted(two["bound"].items()))
        name = f"{schedule} x{args.interleave}" if schedule == "interleaved" else schedule
        print(f"{name:>14} {mb:3d} {two['seconds']:7.3f} {speedup:7.2f}x {ideal:5.2f}x {speedup / ideal:6.0%} "
              f"{peak:>18} {two['loss']:10.6f}", flush=True)


if __name__ == "__main__":
    main()
