"""The trainer's ``pipeline`` config across 2 processes, one stage each, per schedule: tokens/s against one process.

    python benchmarks/trainer_processes.py [--steps 25] [--microbatches 4] [--interleave 2]
        [--schedules gpipe,1f1b,interleaved,zb-h1,zb-h2] [key.sub=value ...]

Measured in one run, each with its own fresh processes:

- one process pinned to core 0 with one CPU device, the same model without a
  pipeline (``layout.mesh={data: 1} layout.pipeline=null``): the baseline;
- per schedule, ``multimesh-train pipeline --coordinator ... --num-processes 2
  --process-id i`` (docs/multiprocess.md), process i pinned to core i with one
  CPU device, so that each stage is one device on its own core
  (``layout.mesh={data: 1}``), ``--microbatches`` microbatches (interleaved:
  ``--interleave`` layer groups per stage).

tokens/s from the trainer's metrics (``metrics.jsonl``, a line every
``LOG_EVERY`` steps, where the trainer waits for its steps anyway): the tokens
of the steps after the first line, over the wall time between the first line
and the last one before the final step (whose line comes after validation);
compilation and any later first-use work in the first steps are left out.
Extra ``key=value`` overrides go to every run. Needs 2 free cores
(``taskset``); the numbers mean little on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from multiprocess_pipeline import one_device_env, pinned  # this script's folder is on sys.path

REPO = Path(__file__).resolve().parent.parent
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
LOG_EVERY = 4  # the trainer's own sync interval (trainers.train.SYNC_EVERY): the lines add no waits
# no validation or checkpoints but the last ones (the trainer always ends with both, after the timed lines)
QUIET = ["train.eval_every=100000", "train.eval_batches=1", "train.checkpoint_every=0",
         f"train.log_every={LOG_EVERY}"]


def _command(core: int, overrides: list[str], out: Path, extra: list[str]) -> list[str]:
    return [*pinned(core), sys.executable, "-m", "trainers", "pipeline", *QUIET, *overrides, f"train.out_dir={out}",
            "-q", *extra]


def _env() -> dict[str, str]:
    return one_device_env(PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _finish(procs: list[subprocess.Popen], what: str, timeout: float) -> None:
    """Wait for ``procs`` (ours); end the ones still running on a failure or timeout, by their handle."""
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, err) in enumerate(zip(procs, errs)):
        if p.returncode != 0:
            raise SystemExit(f"{what}: process {i} failed ({p.returncode}):\n{err[-3000:]}")


def _tokens_per_s(out: Path, steps: int) -> float:
    """Tokens/s between the first metrics line and the last one before step ``steps``."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in lines if r["step"] < steps]
    if len(timed) < 2:
        raise SystemExit(f"{out}: fewer than 2 metrics lines before step {steps}: raise --steps")
    first, last = timed[0], timed[-1]
    tokens_per_step = json.loads((out / "summary.json").read_text())["tokens_per_step"]
    return (last["step"] - first["step"]) * tokens_per_step / (last["wall_time"] - first["wall_time"])


def one_process(steps: int, extra: list[str], out: Path, timeout: float) -> float:
    over = ["layout.mesh={data: 1}", "layout.pipeline=null", f"train.steps={steps}", *extra]
    proc = subprocess.Popen(_command(0, over, out, []), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _finish([proc], "one process", timeout)
    return _tokens_per_s(out, steps)


def two_processes(schedule: str, args: argparse.Namespace, out: Path) -> float:
    from multimesh.distributed import reserve_port

    port = reserve_port("127.0.0.1")  # held by this process so that no other bind takes it before gRPC's
    over = ["layout.mesh={data: 1}", f"layout.pipeline.schedule={schedule}",
            f"layout.pipeline.microbatches={args.microbatches}", f"train.steps={args.steps}", *args.overrides]
    if schedule == "interleaved":
        over.append(f"layout.pipeline.interleave={args.interleave}")
    procs = [subprocess.Popen(_command(i, over, out, ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                                      "--process-id", str(i)]),
                              cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    _finish(procs, f"schedule {schedule}", args.timeout)
    return _tokens_per_s(out, args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    parser.add_argument("--steps", type=int, default=6 * LOG_EVERY + 1,
                        help=f"train steps per run (timed: from step {LOG_EVERY} to the last multiple of "
                             f"{LOG_EVERY} before the last)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--interleave", type=int, default=2, help="layer groups per stage (interleaved)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: unknown {unknown}; use some of {list(SCHEDULES)}")

    load = os.getloadavg()[0]
    timed = (args.steps - 1) // LOG_EVERY * LOG_EVERY - LOG_EVERY
    print(f"trainer config pipeline, {args.steps} steps ({timed} timed), {os.cpu_count()} cores, "
          f"load average {load:.2f}; overrides {args.overrides or 'none'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = one_process(args.steps, args.overrides, Path(tmp) / "one", args.timeout)
        print(f"{'run':34s} {'tokens/s':>9s} {'vs 1 process':>12s}")
        print(f"{'1 process, 1 core, 1 device':34s} {base:9,.0f} {1:11.2f}x", flush=True)
        for schedule in schedules:
            rate = two_processes(schedule, args, Path(tmp) / schedule)
            name = f"{schedule} x{args.interleave}" if schedule == "interleaved" else schedule
            print(f"{'2 processes, ' + name + f', {args.microbatches} mb':34s} {rate:9,.0f} {rate / base:11.2f}x",
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
