"""Real concurrency: a 2-stage pipeline on 2 processes, each pinned to its own core.

Simulated devices in one process share its threads; processes run on
different cores at once. Measured in one run:

- single: one process pinned to core 0, one CPU device, the whole model's
  train step as one `jax.jit` (no pipeline): the obvious alternative;
- pipeline: 2 processes (`multimesh.distributed`), process i pinned to core i
  with one CPU device, one stage each, 8 microbatches, 1F1B.

Printed: tokens/s of both, their ratio, and the efficiency against the
schedule's ideal speed-up ``stages * (1 - bubble)``. The model is a stack of
per-token MLP blocks (``--layers`` blocks of ``--width`` x 4``--width``),
half of them on each stage; adam.

    python benchmarks/multiprocess_pipeline.py [--steps 20] [--layers 8] [--width 512] [--batch 64] [--seq 32]

Needs 2 free cores (``taskset``); the numbers mean little on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time


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

    per = args.layers // 2
    parts = [block, block] if stages is None else stages

    def loss(ps, batch):
        h = batch["x"]
        for s, part in enumerate(parts):
            h = part(ps[s * per:(s + 1) * per], h)
        return jnp.mean((h - batch["y"]) ** 2) / args.microbatches

    def state_init():
        p = init()["p"]
        return {"p": p, "o": tx.init(p)}

    def step(state, batch):
        if stages is None:
            value, grads = jax.value_and_grad(lambda p, b: loss(p, b) * args.microbatches)(state["p"], batch)
        else:
            mb = args.batch // args.microbatches
            value, grads = jax.value_and_grad(microbatch(loss, 0, mb, argnum=1, schedule="1f1b"))(state["p"], batch)
        updates, opt = tx.update(grads, state["o"], state["p"])
        return value, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    return state_init, step


def batch(args: argparse.Namespace):
    import jax

    kx, ky = jax.random.split(jax.random.key(1))
    shape = (args.batch, args.seq, args.width)
    return {"x": jax.random.normal(kx, shape), "y": jax.random.normal(ky, shape)}


def timed(step, state, b, steps: int) -> tuple[float, float]:
    """Seconds per step after 3 warm-up steps; and the last loss."""
    import jax

    for _ in range(3):
        value, state = step(state, b)
    float(value)
    start = time.perf_counter()
    for _ in range(steps):
        value, state = step(state, b)
    loss = float(value)
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / steps, loss


def single(args: argparse.Namespace) -> dict:
    import jax

    init, step = model(args, None)
    seconds, loss = timed(jax.jit(step), jax.jit(init)(), jax.jit(lambda: batch(args))(), args.steps)
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
    seconds, loss = timed(fn, init_p(), get_b(), args.steps)
    out = {"seconds": seconds, "loss": loss, "bubble": fn.plan.schedule.bubble_fraction}
    jax.distributed.shutdown()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, role: list[str], core: int) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    cmd = [*pin, sys.executable, __file__, *role, "--steps", str(args.steps), "--layers", str(args.layers),
           "--width", str(args.width), "--batch", str(args.batch), "--seq", str(args.seq),
           "--microbatches", str(args.microbatches)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def result(p: subprocess.Popen, timeout: float = 900) -> dict:
    out, _ = p.communicate(timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"a benchmark process failed ({p.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
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
    port = free_port()
    procs = [launch(args, ["--process", str(i), "--port", str(port)], i) for i in range(2)]
    two = [result(p) for p in procs]
    tokens = args.batch * args.seq
    rate_one, rate_two = tokens / one["seconds"], tokens / two[0]["seconds"]
    ideal = 2 * (1 - two[0]["bubble"])
    print(f"model: {args.layers} blocks of {args.width}x{4 * args.width}, batch {args.batch} x {args.seq} tokens, "
          f"{args.microbatches} microbatches (1F1B), {args.steps} timed steps, {os.cpu_count()} cores")
    print(f"{'':>34} {'s/step':>8} {'tokens/s':>10}")
    print(f"{'1 process, 1 core, 1 device (jit)':>34} {one['seconds']:8.3f} {rate_one:10.0f}")
    print(f"{'2 processes, 1 core each, pipeline':>34} {two[0]['seconds']:8.3f} {rate_two:10.0f}")
    print(f"speed-up {rate_two / rate_one:.2f}x; ideal for this schedule 2 x (1 - bubble {two[0]['bubble']:.3f}) = "
          f"{ideal:.2f}x; efficiency {rate_two / rate_one / ideal:.0%}")
    print(f"final loss: single {one['loss']:.6f}, pipeline {two[0]['loss']:.6f}")


if __name__ == "__main__":
    main()
