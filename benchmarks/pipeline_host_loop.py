"""Where a pipeline's first step goes as the microbatches grow, and what the host costs per action.

    python benchmarks/pipeline_host_loop.py [--microbatches 4 16 64] [--batch 64] [--rounds 5]

The trainer's `pipeline` config (2 stages of data=2 x tensor=2, 1F1B) with a
global batch of ``--batch`` sequences split into each number of microbatches
(the same tokens per step), each in a fresh process without a compilation
cache, 8 simulated CPU devices. Per row:

- first step: seconds from building the step to the first step's result,
  initialisation included (what a user waits for), split into tracing the
  step, inlining its nested calls (`plan.partition.inline_calls`), planning
  (`partition`: colouring, segments, schedule), the runtime's set-up
  (grouping segments into programs, the per-segment bookkeeping), XLA's
  compilations (count and seconds, init's included) and the rest of init and
  the first call (the actions themselves);
- steady: the median step over ``--rounds`` rounds of 3 steps;
- per action (one program execution of the plan): the runtime's step time
  over its executions; *replay*: the same programs and copies called back to
  back with the recorded arguments, without the runtime; *bare jit*: one
  stage program (the first stage's forward) called synchronously with its
  own arguments, as a hand-written ``jax.jit`` would be; and the runtime's
  own Python per action (its time outside the programs' and copies' calls, in a step it runs without
  waiting for results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _timed(owner: Any, name: str, totals: dict[str, float], key: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its seconds to ``totals[key]``."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t

    setattr(owner, name, wrapper)


def measure(n_mb: int, batch_size: int, rounds: int) -> dict:
    """One number of microbatches, in this (fresh) process."""
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    import numpy as np

    import multimesh.plan.partition as partition_module
    import multimesh.run.runtime as runtime_module
    from trainers.config import load_config
    from trainers.layout import build_layout
    from trainers.step import build_program

    phases: dict[str, float] = {}
    _timed(partition_module, "inline_calls", phases, "inline")
    _timed(partition_module, "partition", phases, "partition")
    _timed(runtime_module.Runtime, "__init__", phases, "runtime_setup")
    compiles = [0, 0.0]

    def on_event(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1
            compiles[1] += duration

    jax.monitoring.register_event_duration_secs_listener(on_event)
    cfg = load_config("pipeline", [f"data.batch_size={batch_size}", f"layout.pipeline.microbatches={n_mb}"])
    tokens = np.random.default_rng(0).integers(0, 256, (batch_size, cfg.data.seq_len + 1), dtype=np.int32)
    batch = {"tokens": tokens}
    layout = build_layout(cfg.layout)
    t0 = time.perf_counter()
    with layout.tasks(cfg.model.num_layers):
        program = build_program(cfg, layout, batch, {"tokens": tokens[:8]})
        build_s = time.perf_counter() - t0
        state = jax.block_until_ready(program.init())
        metrics, state = program.step(state, batch)
        jax.block_until_ready(metrics)
        first_s = time.perf_counter() - t0
        for _ in range(2):
            metrics, state = program.step(state, batch)
        jax.block_until_ready(metrics)
        per_round = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(3):
                metrics, state = program.step(state, batch)
                jax.block_until_ready(metrics)
            per_round.append((time.perf_counter() - t) / 3)
        step_s = statistics.median(per_round)
        runtime = program.step.runtime
        executions = program.step.stats.executions
        host = _host_costs(program, state, batch, runtime_module, rounds)
    return {"microbatches": n_mb, "batch": batch_size, "executions": executions,
            "programs": len(runtime.programs), "build_s": build_s, "first_s": first_s, "step_s": step_s,
            "compiles": compiles[0], "compile_s": compiles[1], **{f"{k}_s": v for k, v in phases.items()},
            **host}


def _host_costs(program: Any, state: Any, batch: Any, runtime_module: Any, rounds: int) -> dict:
    """Per action: the runtime, its replay without it, one bare program call, and the runtime's own Python."""
    import jax

    runtime = program.step.runtime
    steps = runtime.steps
    calls: list[tuple[Any, tuple]] = []
    inside = [0.0]
    move = runtime_module.move

    def recording_move(xs: Any, targets: Any) -> Any:
        t = time.perf_counter()
        out = move(xs, targets)
        inside[0] += time.perf_counter() - t
        calls.append((move, (list(xs), list(targets))))
        return out

    kept: dict[int, tuple] = {}  # each program's first arguments, copied: the step donates some of them

    def recorded(fn: Any) -> Any:
        def call(*args: Any) -> Any:
            t = time.perf_counter()
            if id(fn) not in kept:
                kept[id(fn)] = tuple(x.copy() if isinstance(x, jax.Array) else x for x in args)
            out = fn(*args)
            inside[0] += time.perf_counter() - t
            calls.append((fn, args))
            return out
        return call

    originals = [s.fn for s in steps]
    runtime_module.move = recording_move
    for s in steps:
        s.fn = recorded(s.fn)
    try:  # one recorded step (not donating: the recorded arguments stay alive for the replay)
        donate = [p.donate for p in runtime.programs]
        sync_every, runtime.sync_every = runtime.sync_every, 0  # no waits inside: its Python alone is timed
        t = time.perf_counter()
        out = program.step(state, batch)
        recorded_s = time.perf_counter() - t  # the actions dispatched (XLA:CPU runs most while dispatching)
        jax.block_until_ready(out)
    finally:
        runtime.sync_every = sync_every
        runtime_module.move = move
        for s, fn in zip(steps, originals):
            s.fn = fn
    state = out[1]
    n = len(steps)
    own_python_us = max(recorded_s - inside[0], 0.0) / n * 1e6

    def replay() -> float:
        t = time.perf_counter()
        last = None
        for f, args in calls:
            last = f(*args)
        jax.block_until_ready(last)
        return (time.perf_counter() - t) / n

    def runtime_step() -> float:
        nonlocal state
        t = time.perf_counter()
        metrics, state = program.step(state, batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - t) / n

    donating = {id(fn) for fn, p in zip([_program_fn(runtime, p) for p in runtime.programs], runtime.programs)
                if p.donate}
    stage_program = next(i for i, s in enumerate(steps) if s.segment.action is not None
                         and id(originals[i]) not in donating)  # the first stage's forward
    fn = originals[stage_program]
    args = kept[id(fn)]

    def bare() -> float:
        reps = 20
        t = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
        return (time.perf_counter() - t) / reps

    results: dict[str, list[float]] = {"runtime": [], "replay": [], "bare": []}
    can_replay = not any(donate)
    for _ in range(rounds):
        results["runtime"].append(runtime_step())
        if can_replay:
            results["replay"].append(replay())
        results["bare"].append(bare())
    med = {k: statistics.median(v) * 1e6 if v else float("nan") for k, v in results.items()}
    return {"action_us": med["runtime"], "replay_us": med["replay"], "bare_jit_us": med["bare"],
            "own_python_us": own_python_us}


def _program_fn(runtime: Any, program: Any) -> Any:
    """The jitted function the runtime calls for ``program``."""
    return runtime.steps[program.segments[0]].fn


COLUMNS = [("mb", "microbatches", "{:d}"), ("execs", "executions", "{:d}"), ("progs", "programs", "{:d}"),
           ("first s", "first_s", "{:.1f}"), ("x mb0", None, "{:.2f}"), ("trace s", "trace_s", "{:.1f}"),
           ("inline s", "inline_s", "{:.1f}"), ("plan s", "partition_s", "{:.1f}"),
           ("setup s", "runtime_setup_s", "{:.1f}"), ("compiles", "compiles", "{:d}"),
           ("compile s", "compile_s", "{:.1f}"), ("step ms", "step_ms", "{:.0f}"),
           ("us/action", "action_us", "{:.0f}"), ("replay us", "replay_us", "{:.0f}"),
           ("bare jit us", "bare_jit_us", "{:.0f}"), ("python us", "own_python_us", "{:.0f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.batch, args.rounds)))
        return
    print(f"pipeline config, global batch {args.batch} x 128 tokens; each row a fresh process, no compilation "
          f"cache; {os.cpu_count()} cores; medians of {args.rounds} rounds")
    print("  ".join(f"{h:>{max(len(h), 5)}s}" for h, _, _ in COLUMNS))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    base = None
    for n_mb in args.microbatches:
        out = subprocess.run([sys.executable, __file__, "--one", str(n_mb), "--batch", str(args.batch),
                              "--rounds", str(args.rounds)], capture_output=True, text=True, cwd=ROOT, env=env,
                             check=False)
        if out.returncode:
            print(f"{n_mb}: failed\n{out.stderr[-3000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = base or r
        r["step_ms"] = r["step_s"] * 1e3
        r["trace_s"] = r["build_s"] - r.get("inline_s", 0) - r.get("partition_s", 0) - r.get("runtime_setup_s", 0)
        cells = []
        for h, key, fmt in COLUMNS:
            value = r["first_s"] / base["first_s"] if key is None else r.get(key, float("nan"))
            cells.append(f"{fmt.format(value):>{max(len(h), 5)}s}")
        print("  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
