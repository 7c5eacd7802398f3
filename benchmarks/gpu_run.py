"""Step time and MFU of the example model on one GPU, against the planner's prediction; a table for RESULTS.md.

    python benchmarks/gpu_run.py [--configs gpu_small gpu_medium gpu_1b] [--steps 10] [--rounds 3]
    python benchmarks/gpu_run.py --dry-run     # CPU: the same code on shrunk configs, 1 step (a test runs it)

For each config, in a fresh process (one config's buffers do not crowd the
next): the trainer's step exactly as ``multimesh-train`` builds it (SPMD on a
1-device mesh, synthetic token batches), its estimate on the GPU's datasheet
profile (`multimesh.estimate`, each product priced in its dtype), then
``--rounds`` rounds of ``--steps`` steps after 2 warm-up steps; the median
round gives the step time. MFU is the model's flops (``6 x parameters x
tokens`` plus attention's ``12 x layers x seq_len x heads x head_dim`` per
token: `trainers.plan_estimate.model_flops_of`) over the step time and the
GPU's peak for the compute dtype. The attention kernel the model ran
(`models.attention`: cuDNN's fused kernel or XLA's) is printed with it.
Bounded: three configs at the defaults take a few minutes on one H100,
most of it compiling.

``--dry-run`` shrinks each config (2 layers, width 64, 32 tokens, batch 2),
runs one round of one step on whatever device is there, and prices it on an
H100's datasheet: every number is the code path's, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import datasheet_profile, timed_rounds  # noqa: E402  (benchmarks/ is not a package)

#: What ``--dry-run`` changes in each config: a model small enough for a CPU, the same code path.
DRY_RUN = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2",
           "model.max_len=32", "data.seq_len=32", "data.batch_size=2"]
DRY_RUN_PROFILE = "h100-sxm"



def attention_kernel(cfg) -> str:
    """The kernel `models.attention` runs for ``cfg`` on this machine's default device."""
    import jax
    import jax.numpy as jnp

    from models.attention import pick_implementation

    m = cfg.model
    q = jax.ShapeDtypeStruct((1, cfg.data.seq_len, m.num_heads, m.head_dim), jnp.dtype(m.dtype))
    k = jax.ShapeDtypeStruct((1, cfg.data.seq_len, m.num_kv_heads, m.head_dim), jnp.dtype(m.dtype))
    return pick_implementation(m.attention, q, k) or "xla"


def measure(name: str, steps: int, rounds: int, dry_run: bool) -> dict:
    """One config in this (fresh) process."""
    import jax
    import numpy as np

    from multimesh.estimate import get_profile
    from trainers.config import load_config
    from trainers.plan_estimate import model_flops_of
    from trainers.step import program_for

    device = jax.devices()[0]
    cfg = load_config(name, ["layout.mesh={data: 1}", *(DRY_RUN if dry_run else [])])
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.seq_len + 1),
                                    dtype=np.int32)}
    t0 = time.perf_counter()
    program = program_for(cfg, [device], batch)
    profile = DRY_RUN_PROFILE if dry_run else datasheet_profile(device.device_kind)
    flops = model_flops_of(cfg)
    est = program.step.estimate(profile=profile, model_flops=flops) if profile else None
    state = jax.block_until_ready(program.init())
    placed = jax.device_put(batch, device)
    for _ in range(1 if dry_run else 2):
        metrics, state = program.step(state, placed)
    jax.block_until_ready((metrics, state))
    first_s = time.perf_counter() - t0
    step_s, per_round, metrics, state = timed_rounds(program.step, state, placed, rounds=rounds, steps=steps)
    dtype = np.dtype(cfg.model.dtype).name
    peak = get_profile(profile).flops_rate(dtype) if profile else float("nan")
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(program.abstract_state["params"]))
    predicted = est.time.total if est is not None and est.time else float("nan")
    return {
        "config": name, "device": device.device_kind, "profile": profile, "dry_run": dry_run,
        "params": params, "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len, "dtype": dtype,
        "attention": attention_kernel(cfg), "model_flops": flops, "peak_flops": peak,
        "start_s": first_s, "step_s": step_s, "rounds_s": per_round, "loss": float(metrics["loss"]),
        "predicted_s": predicted, "mfu": flops / (step_s * peak),
        "predicted_mfu": flops / (predicted * peak),
    }


HEADER = ("| config | params | tokens/step | attention | step: predicted / measured | MFU: predicted / measured "
          "| start-up |\n|---|---|---|---|---|---|---|")


def table_row(r: dict) -> str:
    return (f"| {r['config']} ({r['dtype']}) | {r['params'] / 1e6:,.1f}M | {r['tokens_per_step']:,} | "
            f"{r['attention']} | {r['predicted_s'] * 1e3:,.2f} / **{r['step_s'] * 1e3:,.2f} ms** | "
            f"{r['predicted_mfu']:.1%} / **{r['mfu']:.1%}** | {r['start_s']:.0f} s |")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["gpu_small", "gpu_medium", "gpu_1b"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="shrunk configs, one step: runs on a CPU")
    parser.add_argument("--json", default=None, help="also write every number here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps, rounds = (1, 1) if args.dry_run else (args.steps, args.rounds)
    if args.one:
        print(json.dumps(measure(args.one, steps, rounds, args.dry_run)))
        return []
    rows = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    for name in args.configs:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--steps", str(steps),
               "--rounds", str(rounds), *(["--dry-run"] if args.dry_run else [])]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=root, env=env).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    import jax

    print(f"jax {jax.__version__}, device: {rows[0]['device'] if rows else '?'}, priced on the "
          f"{rows[0]['profile'] if rows else '?'} datasheet; median of {rounds} rounds of {steps} steps"
          f"{' (DRY RUN: shrunk configs, not a measurement)' if args.dry_run else ''}")
    print(HEADER)
    for r in rows:
        print(table_row(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
