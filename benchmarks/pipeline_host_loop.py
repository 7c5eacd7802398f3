"""Where a pipeline's first step goes as the microbatches grow, and what the host costs per action.

    python benchmarks/pipeline_host_loop.py [--microbatches 4 16 64] [--batch 64] [--rounds 5]
        [--schedules 1f1b gpipe] [--groups 1 8] [--set data.seq_len=8 ...] [--warm-cache]

The trainer's `pipeline` config (2 stages of data=2 x tensor=2) with a global
batch of ``--batch`` sequences split into each number of microbatches (the
same tokens per step), run by each schedule, with the runtime grouping at most
each of ``--groups`` consecutive actions of a stage into one host call
(``MULTIMESH_GROUP_ACTIONS``; 1: each action its own call), each row in a
fresh process without a compilation cache (``--warm-cache``: with one that an
unmeasured run of the same row filled, as a rerun has), 8 simulated CPU devices. Per row:

- first step: seconds from building the step to the first step's result,
  initialisation included (what a user waits for), split into tracing the
  step, inlining its nested calls (`plan.partition.inline_calls`), planning
  (`partition`: colouring, segments, schedule), the runtime's set-up
  (grouping segments into programs, the per-segment bookkeeping), XLA's
  compilations (count and seconds, init's included) and the rest of init and
  the first call (the actions themselves);
- steady (*step ms*): the median step over ``--rounds`` rounds of 3 steps; *alone ms*: the same
  runtime, each action its own host call (in the grouped order), in rounds interleaved with those
  (which runs first alternates: the first of a pair runs some 10% slower here);
- host calls per step (*calls*; the actions are *execs*) and the number of
  executables the runtime's programs and groups compiled to;
- per action (one segment's execution): the runtime's step time over its
  executions; *replay*: the same programs and copies called back to
  back with the recorded arguments, without the runtime; *bare jit*: one
  stage program (the first action the runtime calls alone: the first stage's
  forward, or with groups its first backward) called synchronously with its
  own arguments, as a hand-written ``jax.jit`` would be; and the runtime's
  own Python per action (its time outside the programs' and copies' calls, in a step it runs without
  waiting for results, while XLA runs the dispatched programs on the same cores); *bookkeeping*: that
  Python alone (`Runtime.__call__` with every program call and copy answered at once by its recorded
  result, nothing else running).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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


def measure(n_mb: int, batch_size: int, rounds: int, schedule: str, group: int, overrides: list[str],
            cache_dir: str | None = None) -> dict:
    """One number of microbatches, schedule and group bound, in this (fresh) process; with JAX's persistent
    compilation cache at ``cache_dir`` (None: none)."""
    if cache_dir:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    else:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    os.environ["MULTIMESH_GROUP_ACTIONS"] = str(group)
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
    cfg = load_config("pipeline", [f"data.batch_size={batch_size}", f"layout.pipeline.microbatches={n_mb}",
                                   f"layout.pipeline.schedule={schedule}", *overrides])
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
        runtime = program.step.runtime
        grouped = list(runtime.calls)
        alone = [type(c)([s], s.fn, s.args, s.literals, s.outs, s.local) for c in grouped for s in c.steps]
        per_round: dict[str, list[float]] = {"grouped": [], "alone": []}
        ways = [("grouped", grouped), ("alone", alone)]
        for r in range(rounds + 1):  # rounds of 3 steps each way, interleaved; the first warms up (compiles)
            for how, calls in ways if r % 2 else ways[::-1]:  # each way first in every other round
                runtime.calls[:] = calls
                t = time.perf_counter()
                for _ in range(3):
                    metrics, state = program.step(state, batch)
                    jax.block_until_ready(metrics)
                per_round[how].append((time.perf_counter() - t) / 3)
        runtime.calls[:] = grouped
        step_s, alone_s = (statistics.median(per_round[how][1:]) for how in ("grouped", "alone"))
        executions, dispatches = program.step.stats.executions, len(grouped)
        host = _host_costs(program, state, batch, runtime_module, rounds)
    return {"schedule": schedule, "group": group, "microbatches": n_mb, "batch": batch_size,
            "executions": executions, "dispatches": dispatches,
            "programs": len(runtime.programs) + len({id(c.fn) for c in runtime.calls if len(c.steps) > 1}),
            "build_s": build_s, "first_s": first_s, "step_s": step_s, "alone_step_s": alone_s,
            "compiles": compiles[0], "compile_s": compiles[1], **{f"{k}_s": v for k, v in phases.items()},
            **host}


def _host_costs(program: Any, state: Any, batch: Any, runtime_module: Any, rounds: int) -> dict:
    """Per action: the runtime, its replay without it, one bare program call, and the runtime's own Python."""
    import jax

    runtime = program.step.runtime
    host_calls = runtime.calls
    calls: list[tuple[Any, tuple]] = []
    inside = [0.0]
    move = runtime_module.move

    answers: list = []  # each program call's and copy's result, in the order the runtime asked for them

    def recording_move(xs: Any, targets: Any) -> Any:
        t = time.perf_counter()
        out = move(xs, targets)
        inside[0] += time.perf_counter() - t
        calls.append((move, (list(xs), list(targets))))
        answers.append(out)
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
            answers.append(out)
            return out
        return call

    originals = [c.fn for c in host_calls]
    runtime_module.move = recording_move
    for c in host_calls:
        c.fn = recorded(c.fn)
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
        for c, fn in zip(host_calls, originals):
            c.fn = fn
    n = sum(len(c.steps) for c in host_calls)
    own_python_us = max(recorded_s - inside[0], 0.0) / n * 1e6
    bookkeeping_us = _bookkeeping_us(runtime, runtime_module, answers, lambda: program.step(state, batch), n, rounds)
    state = out[1]

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

    donating = {k for p in runtime.programs if p.donate for k in p.segments}
    stage_program = next((i for i, c in enumerate(host_calls) if len(c.steps) == 1
                          and c.steps[0].segment.action is not None
                          and c.steps[0].segment.index not in donating), None)  # the first stage's lone action
    fn = None if stage_program is None else originals[stage_program]

    def bare() -> float:
        reps = 20
        args = kept[id(fn)]
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
        if fn is not None:
            results["bare"].append(bare())
    med = {k: statistics.median(v) * 1e6 if v else float("nan") for k, v in results.items()}
    return {"action_us": med["runtime"], "replay_us": med["replay"], "bare_jit_us": med["bare"],
            "bare_label": None if stage_program is None else host_calls[stage_program].steps[0].label,
            "own_python_us": own_python_us, "bookkeeping_us": bookkeeping_us}


def _bookkeeping_us(runtime: Any, runtime_module: Any, answers: list, step: Any, n: int, rounds: int) -> float:
    """The runtime's own Python per action with nothing else running: its step (`Runtime.__call__`, the
    step's wrapper aside) with every program call and copy answered at once by its recorded result."""
    replies = iter(())

    def answer(*_: Any) -> Any:
        return next(replies)

    calls, move = list(runtime.calls), runtime_module.move
    fns = [c.fn for c in calls]
    spent: dict[str, float] = {}
    inner = type(runtime).__call__
    _timed(type(runtime), "__call__", spent, "step")
    runtime_module.move = answer
    for c in calls:
        c.fn = answer
    try:
        per_step = []
        for _ in range(max(rounds, 3)):
            replies, spent["step"] = iter(answers), 0.0
            step()
            per_step.append(spent["step"])
    finally:
        type(runtime).__call__ = inner
        runtime_module.move = move
        for c, fn in zip(calls, fns):
            c.fn = fn
    return statistics.median(per_step) / n * 1e6


COLUMNS = [("schedule", "schedule", "{:s}"), ("group", "group", "{:d}"), ("mb", "microbatches", "{:d}"),
           ("execs", "executions", "{:d}"), ("calls", "dispatches", "{:d}"), ("progs", "programs", "{:d}"),
           ("first s", "first_s", "{:.1f}"), ("x mb0", None, "{:.2f}"), ("trace s", "trace_s", "{:.1f}"),
           ("inline s", "inline_s", "{:.1f}"), ("plan s", "partition_s", "{:.1f}"),
           ("setup s", "runtime_setup_s", "{:.1f}"), ("compiles", "compiles", "{:d}"),
           ("compile s", "compile_s", "{:.1f}"), ("step ms", "step_ms", "{:.0f}"),
           ("alone ms", "alone_step_ms", "{:.0f}"),
           ("us/action", "action_us", "{:.0f}"), ("replay us", "replay_us", "{:.0f}"),
           ("bare jit us", "bare_jit_us", "{:.0f}"), ("python us", "own_python_us", "{:.0f}"),
           ("bookkeeping us", "bookkeeping_us", "{:.0f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--schedules", nargs="+", default=["1f1b"])
    ap.add_argument("--groups", type=int, nargs="+", default=[1],
                    help="bounds on the actions one host call runs (MULTIMESH_GROUP_ACTIONS; 1: off, the "
                         "trainer's default; --groups 1 8 compares grouped calls)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. data.seq_len=8 (a smaller program per action)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="rows use a persistent compilation cache, each run once unmeasured to fill it first "
                         "(a rerun's first step, as `.ci/train.sh` gives one); default: no cache (a first run)")
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    ap.add_argument("--group", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.batch, args.rounds, args.schedule, args.group, args.set,
                                 args.cache_dir)))
        return
    cache = tempfile.mkdtemp(prefix="host_loop_cache_") if args.warm_cache else None
    print(f"pipeline config {' '.join(args.set)}, global batch {args.batch}; each row a fresh process, "
          f"{'a compilation cache the same row filled' if cache else 'no compilation cache'}; {os.cpu_count()} cores; "
          f"medians of {args.rounds} rounds")
    print("  ".join(f"{h:>{max(len(h), 5)}s}" for h, _, _ in COLUMNS))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    base: dict[tuple, dict] = {}
    for schedule in args.schedules:
        for n_mb in args.microbatches:
            for group in args.groups:
                command = [sys.executable, __file__, "--one", str(n_mb), "--batch", str(args.batch), "--rounds",
                           str(args.rounds), "--schedule", schedule, "--group", str(group), "--set", *args.set]
                if cache:
                    command[2:2] = ["--cache-dir", cache]
                for _ in range(2 if cache else 1):  # with a cache: the first run fills it
                    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
                if out.returncode:
                    print(f"{schedule} {n_mb} {group}: failed\n{out.stderr[-3000:]}")
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                first = base.setdefault((schedule, group), r)  # x mb0: against the fewest microbatches
                r["step_ms"], r["alone_step_ms"] = r["step_s"] * 1e3, r["alone_step_s"] * 1e3
                r["trace_s"] = (r["build_s"] - r.get("inline_s", 0) - r.get("partition_s", 0)
                                - r.get("runtime_setup_s", 0))
                cells = []
                for h, key, fmt in COLUMNS:
                    value = r["first_s"] / first["first_s"] if key is None else r.get(key, float("nan"))
                    cells.append(f"{fmt.format(value):>{max(len(h), 5)}s}")
                print("  ".join(cells), flush=True)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
