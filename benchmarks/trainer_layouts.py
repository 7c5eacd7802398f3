"""Training throughput of each layout config against the same model on one device.

    python benchmarks/trainer_layouts.py [--steps 60] [CONFIG ...]

Runs each config (default: tiny and its layout variants) for ``--steps`` steps
of the trainer, exactly as ``multimesh-train CONFIG`` would but without
checkpoints or validation, and prints tokens/s (timed from the second step, so
compilation is excluded) and the ratio against the one-device run of the same
model (``layout.mesh={data: 1} layout.pipeline=null``), measured in the same
process. On a CPU host the 8 "devices" share the machine's cores, so the
ratios measure multimesh's overhead, not a parallel speed-up.
"""

import argparse
import os
import tempfile

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax

from trainers.config import load_config
from trainers.train import train

LAYOUTS = ["tiny", "dp", "fsdp", "tp", "dp_tp", "pipeline", "pipeline4"]
ONE_DEVICE = ["layout.mesh={data: 1}", "layout.pipeline=null"]
QUIET = ["train.checkpoint_every=0", "train.eval_every=100000"]


def tokens_per_s(name: str, steps: int, extra: list[str], out: str) -> tuple[str, float]:
    cfg = load_config(name, [*QUIET, *extra, f"train.out_dir={out}"])
    result = train(cfg, quiet=True, stop_after=steps)
    return result.config.layout, result.tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="*", default=LAYOUTS)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores, {args.steps} steps")
    print(f"{'config':10s} {'layout':58s} {'tokens/s':>9s} {'1-device':>9s} {'ratio':>6s}")
    reference: dict[bool, float] = {}  # by tied embeddings (an override may untie them)
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.configs):
            cfg = load_config(name)
            tied = cfg.model.tie_embeddings
            if tied not in reference:
                _, reference[tied] = tokens_per_s(name, args.steps, ONE_DEVICE, f"{tmp}/ref{i}")
            layout, rate = tokens_per_s(name, args.steps, [], f"{tmp}/{i}")
            mesh = "x".join(f"{k}={v}" for k, v in layout.mesh.items())
            where = f"mesh {mesh}" + (f", {layout.pipeline.stages} stages {layout.pipeline.schedule} "
                                      f"{layout.pipeline.microbatches} microbatches" if layout.pipeline else "")
            print(f"{name:10s} {where:58s} {rate:9,.0f} {reference[tied]:9,.0f} {rate / reference[tied]:6.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
