"""How a pipeline's start-up and step rate scale with the number of microbatches.

For the trainer's `pipeline` (2 stages) and `pipeline4` (4 stages) configs with
a global batch of 64 sequences split into 4, 8, 16 and 32 microbatches (the
same tokens per step), each in a fresh process with no compilation cache:

- programs: executables JAX lowered and compiled for the first training step;
- first step: seconds from building the step (trace, plan) to the first
  step's result, initialisation included; and its ratio to 4 microbatches;
- steady: seconds per step and tokens/s after warm-up;
- dispatch: per stage execution of a 2-stage pipeline of tiny stages
  (compute negligible, `mpmd_pipeline.py`'s problem) against a bare
  synchronous call of a tiny `jax.jit` on a 4-device submesh, same run; and
  against the same step's programs and copies replayed without the runtime.

    python benchmarks/pipeline_scale.py [--microbatches 4 8 16 32] [--configs pipeline pipeline4] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BATCH = 64


def measure(config: str, n_mb: int, steps: int) -> dict:
    """One configuration, in this (fresh) process."""
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from multimesh.jax import build_mesh, parallelize
    from trainers.config import load_config
    from trainers.layout import build_layout
    from trainers.step import build_program

    lowered = [0]

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)
    cfg = load_config(config, [f"data.batch_size={BATCH}", f"layout.pipeline.microbatches={n_mb}"])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (BATCH, cfg.data.seq_len + 1), dtype=np.int32)
    batch = {"tokens": tokens}
    layout = build_layout(cfg.layout)
    t0 = time.perf_counter()
    with layout.tasks(cfg.model.num_layers):
        program = build_program(cfg, layout, batch, {"tokens": tokens[:8]})
        t_build = time.perf_counter() - t0
        state = program.init()
        jax.block_until_ready(state)
        t_init = time.perf_counter() - t0
        before = lowered[0]
        metrics, state = program.step(state, batch)
        jax.block_until_ready(metrics)
        first = time.perf_counter() - t0
        programs = lowered[0] - before
        executions = program.step.stats.executions
        for _ in range(2):
            metrics, state = program.step(state, batch)
        jax.block_until_ready(metrics)
        t1 = time.perf_counter()
        for _ in range(steps):
            metrics, state = program.step(state, batch)
            jax.block_until_ready(metrics)
        step_s = (time.perf_counter() - t1) / steps

    # dispatch cost per stage execution: tiny stages, compute negligible
    sys.path.insert(0, os.path.dirname(__file__))
    from mpmd_pipeline import problem, replay_costs

    init, get_batch, step = problem(8, 1, 2 * n_mb, n_mb)
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=get_batch, donate=True)
    st, b = init_p(), get_b()
    tiny = jax.jit(lambda x: x + 1.0)
    x = jax.device_put(jnp.zeros((8,)), NamedSharding(build_mesh({"data": 4}, jax.devices()[:4]), P("data")))
    per_exec, per_raw = [], []
    for _ in range(3):
        loss, st = fn(st, b)
        jax.block_until_ready(loss)
        t = time.perf_counter()
        for _ in range(10):
            loss, st = fn(st, b)
            jax.block_until_ready(loss)
        n = fn.stats.executions
        per_exec.append((time.perf_counter() - t) / (10 * n))
        jax.block_until_ready(tiny(x))
        t = time.perf_counter()
        for _ in range(10 * n):
            jax.block_until_ready(tiny(x))
        per_raw.append((time.perf_counter() - t) / (10 * n))
    replay, _, _ = replay_costs(step, init, get_batch, 10)
    return {"config": config, "stages": cfg.layout.pipeline.stages, "microbatches": n_mb, "programs": programs,
            "executions": executions, "build_s": t_build, "init_s": t_init - t_build, "first_step_s": first,
            "step_s": step_s, "tokens_per_s": BATCH * cfg.data.seq_len / step_s,
            "dispatch_us": min(per_exec) * 1e6, "raw_us": min(per_raw) * 1e6, "replay_us": replay * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--configs", nargs="+", default=["pipeline", "pipeline4"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--one", nargs=2, metavar=("CONFIG", "MICROBATCHES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.steps)))
        return
    print(f"global batch {BATCH} x 128 tokens; each row a fresh process without compilation cache; {os.cpu_count()} cores")
    print(f"{'config':10s} {'mb':>3s} {'programs':>8s} {'execs':>6s} {'build s':>8s} {'first s':>8s} {'x mb=4':>7s} "
          f"{'step ms':>8s} {'tokens/s':>9s} {'x mb=4':>7s} {'disp us':>8s} {'raw us':>7s} {'ratio':>6s} "
          f"{'replay us':>9s} {'x replay':>8s}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for config in args.configs:
        base = None
        for n_mb in args.microbatches:
            out = subprocess.run([sys.executable, __file__, "--one", config, str(n_mb), "--steps", str(args.steps)],
                                 capture_output=True, text=True, cwd=root, check=False)
            if out.returncode:
                print(f"{config} {n_mb}: failed\n{out.stderr[-2000:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            base = base or r
            print(f"{config:10s} {n_mb:3d} {r['programs']:8d} {r['executions']:6d} {r['build_s']:8.1f} "
                  f"{r['first_step_s']:8.1f} {r['first_step_s'] / base['first_step_s']:7.2f} {r['step_s'] * 1e3:8.1f} "
                  f"{r['tokens_per_s']:9,.0f} {r['tokens_per_s'] / base['tokens_per_s']:7.2f} "
                  f"{r['dispatch_us']:8.0f} {r['raw_us']:7.0f} {r['dispatch_us'] / r['raw_us']:6.2f} "
                  f"{r['replay_us']:9.0f} {r['dispatch_us'] / r['replay_us']:8.2f}", flush=True)


if __name__ == "__main__":
    main()
