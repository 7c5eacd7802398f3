"""Predicted vs measured step time of every candidate layout of the example transformer.

    python benchmarks/planner.py [--sizes small large] [--steps 2] [--rounds 5] [--multiprocess]

For each model size, on 8 simulated CPU devices: a profile is calibrated once
(`multimesh.estimate.calibrate`, every device busy); then every candidate
layout (`candidates`: all meshes of the 8 devices over data/fsdp/tensor with
the standard rules (``--rule-sets``), and 2- and 4-stage pipelines of 1f1b/zb-h2 at 4/8
microbatches; for the large size by default only the SPMD meshes and the
1f1b pipelines at 8 microbatches without an fsdp axis, `large_subset`, to
keep a run near 15 minutes) is built with the trainer (`load_config`, `program_for`),
its predicted step time taken from
``program.step.estimate(profile)``, and its step measured: after two warm-up
steps (compilation), ``--rounds`` rounds of ``--steps`` steps, the rounds of
all candidates interleaved (so that load drifting on a shared machine hits
every candidate alike), the median round per candidate. Printed per size: a
row per layout (predicted, measured, their ratio and ranks), the Spearman
rank correlation of predicted vs measured, the measured time of the
layout with the lowest predicted time against the best measured, and the
same for the layout ``auto_layout(..., time_top=k)`` would pick, ``k`` the
layouts predicted within 10% of the best (what the search's table suggests
on a host whose devices share cores): each of them timed as `time_layout`
does, one after another after the interleaved rounds.

``--multiprocess``: the 2-process, one-core-each pipeline of
`benchmarks/multiprocess_pipeline.py` (its model, batch and timing), once per
schedule: each process calibrates a profile of the two one-core devices (all
busy, the all-reduce across the processes), then its pipeline's estimate on
that profile is compared with its measured step.

`candidates` are `auto_layout`'s own (`multimesh.autolayout.enumerate_layouts`);
``--rule-sets standard sequence`` adds the sequence rule set's layouts.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from multimesh.autolayout import ParallelLayout, enumerate_layouts
from multimesh.estimate import HardwareProfile

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AXES = ("data", "fsdp", "tensor")
#: Model sizes: overrides of the ``tiny`` config. The batch is 32 sequences so that 8 microbatches still split
#: over a stage's 4 devices; the sequences are short to keep a step well under a second on 2 shared cores.
SIZES = {
    "small": ["model.num_layers=4", "model.d_model=128", "data.seq_len=64", "model.max_len=64",
              "data.batch_size=32"],
    "large": ["model.num_layers=8", "model.d_model=256", "data.seq_len=64", "model.max_len=64",
              "data.batch_size=32"],
}
QUIET = ["train.checkpoint_every=0", "train.eval_every=100000"]


def large_subset(layouts: Sequence[ParallelLayout]) -> list[ParallelLayout]:
    """The larger size's candidates when time is short (``--full-large`` measures them all): every SPMD
    mesh, and the pipelines at 8 microbatches with 1f1b whose stage mesh has no fsdp axis."""
    return [lay for lay in layouts if lay.stages == 1 or (lay.microbatches == 8 and lay.schedule == "1f1b"
                                                             and "fsdp" not in lay.mesh)]


# -- the candidates -------------------------------------------------------------------------------------------

def candidates(rule_sets: Sequence[str] = ("standard",), stages: Sequence[int] = (1, 2, 4)) -> list[ParallelLayout]:
    """Every layout `auto_layout` tries on 8 devices over data/fsdp/tensor with ``stages`` (1f1b and zb-h2
    at 4 and 8 microbatches) and ``rule_sets``: its own `enumerate_layouts`."""
    return list(enumerate_layouts(8, AXES, tuple(stages), (4, 8), ("1f1b", "zb-h2"), tuple(rule_sets)))


def overrides(layout: ParallelLayout) -> list[str]:
    """The trainer config overrides that lay the model out as ``layout``."""
    mesh = "{" + ", ".join(f"{k}: {v}" for k, v in layout.mesh.items()) + "}"
    pipeline = "null" if layout.stages == 1 else (
        f"{{stages: {layout.stages}, microbatches: {layout.microbatches}, schedule: {layout.schedule}}}")
    return [f"layout.mesh={mesh}", f"layout.rules={layout.rules}", f"layout.pipeline={pipeline}"]


# -- measuring ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    layout: ParallelLayout
    predicted: float
    measured: list[float]
    error: str | None = None
    before: float = float("nan")  # predicted by the model before this benchmark (no launch, no sharing)
    timed: float | None = None  # seconds per step as auto_layout(time_top=...) times it (`time_layout`)

    @property
    def median(self) -> float:
        return statistics.median(self.measured) if self.measured else float("nan")


def ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks from 0, tied values given the mean of their ranks."""
    x = np.asarray(x, float)
    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    for v in np.unique(x):
        r[x == v] = r[x == v].mean()
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's of the (tie-averaged) ranks."""
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def size_key(size: list[str]) -> str:
    return " ".join(size)


def host_state(size: list[str]):
    """The train state of a model size on the host (numpy), from the trainer's own initializers."""
    import jax

    from trainers.config import load_config
    from trainers.optim import make_optimizer, schedule_length
    from trainers.step import build_model, initializers

    cfg = load_config("tiny", [*size, *QUIET])
    tx = make_optimizer(cfg.optimizer, schedule_length(cfg.optimizer, cfg.train.steps))
    _, init_state = initializers(cfg, build_model(cfg.model), tx)
    return jax.tree.map(np.asarray, jax.jit(init_state)())


class Built:
    """One candidate built and warmed up: its step, state and placed batch, ready to be timed."""

    def __init__(self, size: list[str], layout: ParallelLayout, profiles: dict, out: str, host_state: dict):
        import jax

        from trainers.config import load_config
        from trainers.step import program_for

        start = time.perf_counter()
        cfg = load_config("tiny", [*size, *QUIET, *overrides(layout), f"train.out_dir={out}"])
        tokens = np.random.default_rng(0).integers(0, 256, (cfg.data.batch_size, cfg.data.seq_len + 1), np.int32)
        batch = {"tokens": tokens}
        self.program = program_for(cfg, batch=batch)
        self.run_layout = self.program.layout
        with self.run_layout.tasks(cfg.model.num_layers, cfg.model.scan_layers):
            self.estimates = {k: self.program.step.estimate(p) for k, p in profiles.items()}
            # the same initial state for every layout, placed with this layout's shardings (its own init
            # program would cost a compilation per candidate and measure nothing)
            shardings = jax.tree.map(lambda a: a.sharding, self.program.abstract_state)
            self.state = jax.device_put(host_state[size_key(size)], shardings)
            self.batch = jax.device_put(batch, self.program.step.batch_shardings)
            for _ in range(2):  # compile, then one step on warm caches
                self._step()
        self.seconds = time.perf_counter() - start

    def _step(self) -> None:
        import jax

        metrics, self.state = self.program.step(self.state, self.batch)
        jax.block_until_ready((metrics, self.state))

    def timed(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps."""
        with self.run_layout.tasks(self.program.config.model.num_layers, self.program.config.model.scan_layers):
            start = time.perf_counter()
            for _ in range(steps):
                self._step()
            return (time.perf_counter() - start) / steps


def measure_size(name: str, layouts: Sequence[ParallelLayout], profile, steps: int, rounds: int) -> list[Row]:
    rows, built = [], []
    profiles = {"now": profile, "before": plain(profile)}
    state = {size_key(SIZES[name]): host_state(SIZES[name])}
    with tempfile.TemporaryDirectory() as tmp:
        for i, layout in enumerate(layouts):
            try:
                b = Built(SIZES[name], layout, profiles, f"{tmp}/{i}", state)
            except Exception as e:  # a layout the trainer refuses is reported, not fatal to the others
                rows.append(Row(layout, float("nan"), [], f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
                continue
            rows.append(Row(layout, b.estimates["now"].time.total, [], before=b.estimates["before"].time.total))
            built.append((rows[-1], b))
            print(f"  built {layout.describe():66s} in {b.seconds:5.1f} s, predicted "
                  f"{rows[-1].predicted * 1e3:8.2f} ms", flush=True)
        for r in range(rounds):
            order = built if r % 2 == 0 else built[::-1]  # alternate the order: no candidate always runs first
            for row, b in order:
                row.measured.append(b.timed(steps))
        time_near_the_best(built)
    del built
    gc.collect()
    return rows


def time_near_the_best(built: list) -> None:
    """What the table's note suggests on this host, ``auto_layout(..., time_top=k)`` for the ``k`` layouts
    predicted within 10% of the best: each timed as `time_layout` times it (one after another, the median of 3
    steps after one), on the steps already built (the trainer's, which donate: each call feeds its state on)."""
    from multimesh.autolayout.table import NEAR_THE_BEST
    from multimesh.autolayout.timing import time_layout

    best = min(row.predicted for row, _ in built)
    for row, b in sorted(built, key=lambda rb: rb[0].predicted):
        if row.predicted > best * NEAR_THE_BEST:  # the search table's own rule
            break
        with b.run_layout.tasks(b.program.config.model.num_layers, b.program.config.model.scan_layers):
            row.timed = time_layout(lambda b=b: (lambda state, batch: b._step(), lambda: None, lambda: None), 3)


def plain(profile):
    """``profile`` as the time model saw it before: no launch or copy overhead, devices not sharing compute."""
    fields = {f.name: getattr(profile, f.name) for f in dataclasses.fields(HardwareProfile)}
    return HardwareProfile(**{**fields, "launch_overhead": 0.0, "copy_latency": 0.0, "alone_speedup": 1.0,
                              "busy_speedup": (), "fresh_memory_rate": 0.0})


def report(name: str, rows: list[Row]) -> dict:
    ok = [r for r in rows if r.error is None]
    predicted, measured = [r.predicted for r in ok], [r.median for r in ok]
    p_rank, m_rank = ranks(predicted), ranks(measured)
    print(f"\n{name}: {len(ok)} layouts measured, {len(rows) - len(ok)} refused")
    print(f"{'layout':66s} {'predicted ms':>12s} {'measured ms':>11s} {'meas/pred':>9s} {'p.rank':>6s} "
          f"{'m.rank':>6s} {'before ms':>9s}")
    for i in np.argsort(predicted, kind="stable"):
        r = ok[i]
        print(f"{r.layout.describe():66s} {r.predicted * 1e3:12.2f} {r.median * 1e3:11.2f} "
              f"{r.median / r.predicted:9.2f} {p_rank[i] + 1:6.1f} {m_rank[i] + 1:6.1f} {r.before * 1e3:9.2f}")
    for r in rows:
        if r.error is not None:
            print(f"{r.layout.describe():66s} refused: {r.error}")
    rho = spearman(predicted, measured)
    pick = ok[int(np.argmin(predicted))]
    best = ok[int(np.argmin(measured))]
    before = [r.before for r in ok]
    print(f"Spearman rank correlation (predicted vs measured): {rho:.3f} (goal >= 0.8); the model before: "
          f"{spearman(before, measured):.3f}")
    rounds = min(len(r.measured) for r in ok)
    if rounds > 1:  # how well the measurements rank the layouts alike from one round to the next
        agree = [spearman([r.measured[a] for r in ok], [r.measured[b] for r in ok])
                 for a, b in itertools.combinations(range(rounds), 2)]
        print(f"the measurements' own rounds, ranked against each other: Spearman {min(agree):.3f} to "
              f"{max(agree):.3f}, median {statistics.median(agree):.3f} (what any prediction can reach against "
              f"one round)")
    print(f"lowest predicted: {pick.layout.describe()} measured {pick.median * 1e3:.2f} ms; best measured: "
          f"{best.layout.describe()} {best.median * 1e3:.2f} ms; ratio {pick.median / best.median:.3f} "
          f"(goal <= 1.10)", flush=True)
    timed = [r for r in ok if r.timed is not None]
    if timed:
        chosen = min(timed, key=lambda r: r.timed)
        print(f"time_top={len(timed)} (the layouts predicted within 10% of the best, timed one after another): "
              f"picks {chosen.layout.describe()}, measured {chosen.median * 1e3:.2f} ms above; ratio "
              f"{chosen.median / best.median:.3f} to the best (goal <= 1.10)", flush=True)
    print("rows: " + json.dumps([{"layout": r.layout.describe(), "predicted": r.predicted, "before": r.before,
                                  "measured": r.measured, "timed": r.timed, "error": r.error} for r in rows]))
    return {"rho": rho, "pick_over_best": pick.median / best.median}


# -- 2 processes, one core each -------------------------------------------------------------------------------

def mp_worker(args: argparse.Namespace) -> None:
    """One process of the 2-process pipeline: calibrate both one-core devices, build, time, estimate."""
    sys.path.insert(0, str(HERE))
    import jax
    import multiprocess_pipeline as mpp
    import numpy as _np
    from jax.sharding import Mesh

    import multimesh.distributed
    from multimesh.estimate import calibrate
    from multimesh.jax import parallelize, task

    multimesh.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.process)
    here = calibrate(jax.devices())  # both devices busy, the all-reduce crossing the processes
    meshes = [Mesh(_np.array([d for d in jax.devices() if d.process_index == p]), ("x",)) for p in range(2)]
    stages = [task(mpp.block, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    margs = argparse.Namespace(**{**vars(mpp_defaults()), "schedule": args.schedule,
                                  "microbatches": args.microbatches, "steps": args.steps, "rounds": args.rounds})
    init, step = mpp.model(margs, stages)
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=lambda: mpp.batch(margs))
    seconds, _, _ = mpp.timed(fn, init_p(), get_b(), margs.steps, margs.rounds)
    est = fn.estimate(here)
    print(json.dumps({"seconds": seconds, "predicted": est.time.total, "before": fn.estimate(plain(here)).time.total,
                      "flops": here.peak_flops["float32"], "bandwidth": here.memory_bandwidth, "link": here.intra_node_bandwidth,
                      "latency": here.intra_node_latency, "alone_speedup": here.alone_speedup}))
    jax.distributed.shutdown()


def mpp_defaults() -> argparse.Namespace:
    """`multiprocess_pipeline.py`'s default model (8 blocks of 512 x 2048, batch 64 x 32, adam)."""
    return argparse.Namespace(layers=8, width=512, batch=64, seq=32, interleave=2, steps=10, rounds=5,
                              microbatches=8, schedule="1f1b")


def multiprocess_rows(schedules: Sequence[str], microbatches: int, steps: int, rounds: int,
                      timeout: float = 600) -> list[Row]:
    sys.path.insert(0, str(HERE))
    from multiprocess_pipeline import one_device_env, pinned

    from multimesh.distributed import reserve_port

    rows = []
    for schedule in schedules:
        port = reserve_port()
        env = one_device_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        procs = []
        for i in range(2):
            procs.append(subprocess.Popen(
                [*pinned(i), sys.executable, __file__, "--mp-worker", "--process", str(i), "--port", str(port),
                 "--schedule", schedule, "--microbatches", str(microbatches), "--steps", str(steps),
                 "--rounds", str(rounds)], env=env, stdout=subprocess.PIPE, text=True))
        results = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=timeout)
                if p.returncode != 0:
                    raise RuntimeError(f"multiprocess worker pid {p.pid} ({schedule}) exited {p.returncode}")
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:  # only ours, by pid
                if p.poll() is None:
                    p.kill()
                    p.wait()
        layout = ParallelLayout({"x": 1}, stages=2, microbatches=microbatches, schedule=schedule)
        row = Row(layout, max(r["predicted"] for r in results), [max(r["seconds"] for r in results)],
                  before=max(r["before"] for r in results))
        print(f"  {schedule:12s} predicted {row.predicted * 1e3:8.2f} ms measured {row.median * 1e3:8.2f} ms; "
              f"profile: {results[0]['flops']:.3g} flop/s, {results[0]['bandwidth']:.3g} B/s, link "
              f"{results[0]['link']:.3g} B/s, latency {results[0]['latency'] * 1e6:.0f} us, one device alone "
              f"{results[0]['alone_speedup']:.2f}x", flush=True)
        rows.append(row)
    return rows


# -- main -----------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--full-large", action="store_true", help="every candidate for the large size too")
    parser.add_argument("--rule-sets", nargs="+", default=["standard"], choices=["standard", "sequence"],
                        help="the rule sets of the layouts measured (auto_layout tries both)")
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 4],
                        help="the stage counts (1: SPMD); every built candidate is held in memory at once, "
                             "and 68 (both rule sets, all stage counts) overflow 24 GiB")
    parser.add_argument("--limit", type=int, default=None, help="measure only the first N candidates (a smoke test)")
    parser.add_argument("--multiprocess", action="store_true", help="also the 2-process, one-core-each pipeline")
    parser.add_argument("--cache", default=None, help="JAX compilation cache directory (default: a fresh one, "
                        "so that a step's run reuses the programs its estimate compiled)")
    parser.add_argument("--mp-schedules", nargs="*", default=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"])
    parser.add_argument("--mp-microbatches", type=int, default=8)
    parser.add_argument("--mp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mp_worker:
        mp_worker(args)
        return

    import jax

    from multimesh.estimate import calibrate

    jax.config.update("jax_compilation_cache_dir", args.cache or tempfile.mkdtemp(prefix="planner-jax-cache-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores, commit {commit}, "
          f"load average {os.getloadavg()[0]:.2f}; median of {args.rounds} rounds of {args.steps} steps")
    start = time.perf_counter()
    here = calibrate()
    print(f"calibrated: {here.peak_flops['float32']:.3g} flop/s, {here.memory_bandwidth:.3g} B/s memory, "
          f"{here.intra_node_bandwidth:.3g} B/s link, {here.intra_node_latency * 1e6:.1f} us latency, "
          f"{here.fresh_memory_rate:.3g} B/s first touch of fresh memory (0: reused), "
          f"{here.launch_overhead * 1e6:.1f} us per program execution, {here.copy_latency * 1e6:.1f} us per copy "
          f"between devices, one device alone {here.alone_speedup:.2f}x "
          f"faster than with all busy; per-device speed-up with k busy: "
          f"{', '.join(f'{k}: {v:.2f}' for k, v in here.busy_speedup)}", flush=True)
    summary = {}
    for name in args.sizes:
        layouts = candidates(args.rule_sets, args.stages)
        if name == "large" and not args.full_large:
            layouts = large_subset(layouts)
        layouts = layouts[:args.limit]
        print(f"\n{name} ({' '.join(SIZES[name])}): {len(layouts)} candidates", flush=True)
        summary[name] = report(name, measure_size(name, layouts, here, args.steps, args.rounds))
    if args.multiprocess:
        print(f"\n2 processes, one core each ({args.mp_microbatches} microbatches):", flush=True)
        rows = multiprocess_rows(args.mp_schedules, args.mp_microbatches, max(args.steps, 3), args.rounds)
        summary["multiprocess"] = report("multiprocess", rows)
    print(f"\n{time.perf_counter() - start:.0f} s in all, load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
