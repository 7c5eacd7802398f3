"""The planner's estimate against a real GPU: memory peaks and step times of the example model's train step.

    python benchmarks/gpu_estimate.py [--configs gpu_small gpu_medium] [--steps 10] [--rounds 5] [--json PATH]

On one GPU, for each config: builds the trainer's step exactly as
``multimesh-train`` does (SPMD, a 1-device mesh, synthetic token batches),
asks ``step.estimate()`` with the GPU's datasheet profile, runs the step and
measures (each config in a fresh process, the allocator's peak being per
process), then estimates again with a profile ``calibrate()`` measures there:

- bytes in use after ``init`` (the train state) against the estimate's
  parameter + optimizer bytes (exact by construction: checks the accounting);
- ``memory_stats()["peak_bytes_in_use"]`` after the steps against the
  estimate's peak (an upper bound: every buffer alive at once);
- the step time (median over ``--rounds`` rounds of ``--steps`` steps, after
  3 warm-up steps) against the predicted step time, and the MFU both imply.

Needs a GPU; prints one line per config and writes every number to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import datasheet_profile, timed_rounds  # noqa: E402  (benchmarks/ is not a package)

from multimesh.estimate import calibrate, get_profile  # noqa: E402
from trainers.config import load_config  # noqa: E402
from trainers.plan_estimate import model_flops_of  # noqa: E402
from trainers.step import program_for  # noqa: E402


def synthetic_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (cfg.data.batch_size, cfg.data.seq_len + 1)
    return {"tokens": rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32)}


def measure(name: str, steps: int, rounds: int, overrides: list[str]) -> dict:
    """One config in a fresh process (the allocator's peak is per process): the datasheet estimate, the
    measured state bytes, peak and step time, then ``calibrate()`` and the estimate with its profile."""
    device = jax.devices()[0]
    cfg = load_config(name, ["layout.mesh={data: 1}", *overrides])
    batch = synthetic_batch(cfg)
    program = program_for(cfg, [device], batch)
    dtype = np.dtype(cfg.model.dtype).name
    sheet = datasheet_profile(device.device_kind)
    t0 = time.perf_counter()
    flops = model_flops_of(cfg)  # 6 x parameters x tokens + attention (PaLM's MFU count)
    # each product priced in the dtype it runs in, read from the program
    est = program.step.estimate(profile=sheet, model_flops=flops) if sheet else program.step.estimate()
    estimate_s = time.perf_counter() - t0
    mem = est.memory[min(est.memory)]

    base = (device.memory_stats() or {}).get("bytes_in_use", 0)  # None on CPU: a dry run there
    state = jax.block_until_ready(program.init())
    state_bytes = (device.memory_stats() or {}).get("bytes_in_use", 0) - base
    placed = jax.device_put(batch, device)
    for _ in range(3):
        metrics, state = program.step(state, placed)
    jax.block_until_ready((metrics, state))
    measured, per_round, metrics, state = timed_rounds(program.step, state, placed, rounds=rounds, steps=steps)
    stats = device.memory_stats() or {}
    loss = float(metrics["loss"])
    del state, metrics, placed
    calibrated = calibrate(matmul_size=8192, copy_bytes=1 << 30, collective_bytes=64 << 20, repeats=5,
                           dtype=jax.numpy.bfloat16)
    est_cal = program.step.estimate(profile=calibrated, model_flops=flops)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(program.abstract_state["params"]))
    tokens = cfg.data.batch_size * cfg.data.seq_len
    model_flops = 6 * n_params * tokens  # the usual dense-transformer count (attention left out)
    peak_rate = get_profile(sheet).flops_rate(dtype) if sheet else float("nan")
    return {
        "config": name, "overrides": overrides, "device": device.device_kind, "params": n_params,
        "tokens_per_step": tokens, "compute_dtype": dtype, "profile": sheet,
        "estimate_seconds": round(estimate_s, 2),
        "est_params_plus_optimizer": mem.params + mem.optimizer, "measured_state_bytes": int(state_bytes),
        "est_peak": mem.peak, "est_temp": mem.temp, "est_outputs": mem.outputs, "est_batch": mem.batch,
        "measured_peak": int(stats.get("peak_bytes_in_use", 0)), "bytes_limit": int(stats.get("bytes_limit", 0)),
        "est_flops": est.flops, "model_flops_6nd": model_flops,
        "predicted_s_datasheet": est.time.total if est.time else None,
        "predicted_s_calibrated": est_cal.time.total,
        "measured_s": measured, "rounds_s": per_round, "loss": loss, "calibrated": repr(calibrated),
        "measured_mfu_6nd": model_flops / (measured * peak_rate),
        "predicted_mfu": est.time.mfu if est.time else None,
        "predicted_hfu": est.time.hfu if est.time else None,
        "predicted_dtype": est.time.dtype if est.time else None,
        "estimate_table": str(est),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["gpu_small", "gpu_medium"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.rounds, [])))
        return
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.platform} {device.device_kind}, "
          f"datasheet profile {datasheet_profile(device.device_kind)}", flush=True)
    rows = []
    for name in args.configs:
        cmd = [sys.executable, __file__, "--one", name, "--steps", str(args.steps), "--rounds", str(args.rounds)]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        print(row["calibrated"])
        print(row["estimate_table"])
        print(f"{name}: {row['params'] / 1e6:.1f}M params | state est {row['est_params_plus_optimizer']:,} B, "
              f"measured {row['measured_state_bytes']:,} B | peak est {row['est_peak']:,} B, measured "
              f"{row['measured_peak']:,} B | step predicted {row['predicted_s_datasheet'] or float('nan'):.4f} s "
              f"(datasheet), "
              f"{row['predicted_s_calibrated']:.4f} s (calibrated), measured {row['measured_s']:.4f} s | "
              f"MFU (6ND) measured {row['measured_mfu_6nd']:.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
