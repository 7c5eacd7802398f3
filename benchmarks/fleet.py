"""Fleet scale, on paper: published training runs predicted from the example model compiled on simulated devices.

    python benchmarks/fleet.py [NAME ...] [--list]

Each published run (``RUNS``: model size, device kind and count, layout and
throughput as published, with its source) is rebuilt as a trainer config of
the example transformer at the published sizes and layout, its train step
compiled from abstract inputs on that many simulated CPU devices (nothing is
allocated) and estimated on the device's hardware profile. The table compares
the predicted throughput per device, in the source's own FLOP count, with the
published figure:

- ``at peak``: the estimate as `multimesh.estimate` makes it on the datasheet
  profile (its flops at the profile's ``achievable_matmul_fraction`` of the
  peak where one was measured, alpha-beta collectives beside the compute
  unless critical: `multimesh.estimate.timing`);
- ``at MAMF`` (GPUs only): the same with the bfloat16 peak replaced by an
  independently measured *maximum achievable matmul* rate (``ACHIEVABLE``:
  torch's cuBLAS at its best shape; the A100 profile carries the same
  fraction, the Hopper profiles the lower rate XLA reached on an H200).
  Nothing is fitted to the figures compared against.

Depth: the step is compiled at 1 and at 2 layers (unrolled, not scanned) and
its flops, bytes and collective time extrapolated linearly to the published
depth (the blocks are identical, so each is exactly linear in the number of
layers). A scanned stack would compile as fast, but XLA's cost analysis and
`estimate` count a loop body once, not once per layer: its flops, bytes and
collectives (the tiny config scanned: 2.9e8 flops at 2 layers, 3.0e8 at 4;
unrolled: 5.1e8 and 9.7e8), which would hide most of the step.

Run with the worktree on ``PYTHONPATH``; it sets the simulated device count
(the largest run's) before JAX starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ACHIEVABLE", "RUNS", "Prediction", "PublishedRun", "predict"]


@dataclass(frozen=True)
class PublishedRun:
    """One published training configuration and its throughput, as its source states them."""

    name: str
    source: str
    profile: str  # a multimesh.estimate profile name
    devices: int
    mesh: dict[str, int]  # the published layout as the trainer's mesh (standard rules)
    d_model: int
    num_layers: int
    num_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    seq_len: int
    global_batch: int
    tie_embeddings: bool
    remat: bool
    published_tflops: float  # per device, in the source's FLOP count
    source_flops: Callable[[PublishedRun], float]  # one step's flops, all devices, as the source counts them
    notes: str = ""
    num_kv_heads: int | None = None  # grouped-query attention's key/value heads (None: num_heads)
    grad_accum: int = 1  # micro-steps whose gradients one step accumulates (the trainer's train.grad_accum)
    num_experts: int = 0  # routed experts per block (models.moe; 0: a dense MLP, d_ff wide), each d_ff wide
    experts_per_token: int = 2  # the top-k of an MoE block
    moe_capacity_factor: float | None = None  # each expert's capacity per device's tokens (models.moe; None: dropless)


def megatron_flops(r: PublishedRun) -> float:
    """Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh), recomputation's extra forward included."""
    b, s, l, h, v = r.global_batch, r.seq_len, r.num_layers, r.d_model, r.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def maxtext_flops(r: PublishedRun) -> float:
    """MaxText's training TFLOP count as of 2023-12 (``MaxText/train.py`` ``calculate_training_tflops``, PaLM
    appendix B): 6 x parameters x tokens plus causal attention 6 B s^2 heads head_dim per layer. The parameters
    are the example model's: its SwiGLU of equal width holds the published ReLU MLP's parameters to 0.1%."""
    b, s, e, hd = r.global_batch, r.seq_len, r.d_model, r.head_dim
    kv = r.num_kv_heads or r.num_heads
    block = e * hd * (2 * r.num_heads + 2 * kv) + 3 * e * r.d_ff + 2 * e
    params = r.num_layers * block + r.vocab * e * (1 if r.tie_embeddings else 2) + e
    return 6 * params * b * s + 6 * r.num_layers * r.num_heads * hd * s * s * b


def swiglu_width(d_model: int) -> int:
    """The SwiGLU hidden width whose three matrices hold GPT's two 4h ones (8h^2), rounded to 64."""
    return round(8 * d_model / 3 / 64) * 64


MEGATRON = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using "
            "Megatron-LM (SC'21, arXiv:2104.04473), Table 1; A100 80GB (Selene), V=51200, s=2048, activation "
            "recomputation, TFLOP/s per GPU by their eq. (3)")
MAXTEXT_2023 = ("google/maxtext commit 76bd53b0f44caf989c88189afadeb1062f9254f0 (2023-12-15), the date these "
                "figures were published: ")
MAXTEXT_SIZES = ("sizes from that commit's MaxText/configs/base.yml (base_emb_dim 2560, base_num_heads 8, head_dim 256, "
                 "base_mlp_dim 8192 with mlp_activations [relu], 16 layers, vocab_size 32768, logits_via_embedding) "
                 "scaled by pyconfig.get_individual_scales")
MAXTEXT_V5P = (MAXTEXT_2023 + "MaxText/configs/v5p/README.md (32B, 1x v5p-128: 328 TFLOP/sec/chip, 71.47% MFU) and "
               "MaxText/configs/v5p/32b.sh (global_parameter_scale=32, ici_tensor_parallelism=4, fsdp the rest, "
               "per_device_batch_size=8, max_target_length=2048, remat_policy=minimal); " + MAXTEXT_SIZES +
               "(32): emb x4, heads x4, mlp x4, layers x2")
MAXTEXT_V5E = (MAXTEXT_2023 + "MaxText/configs/v5e/README.md (16B, 1x v5e-256: 120 TFLOP/sec/chip, 61.10% MFU) and "
               "MaxText/configs/v5e/16b.sh (global_parameter_scale=16, fsdp over all 256 chips, "
               "per_device_batch_size=6, max_target_length=2048, remat_policy=full); " + MAXTEXT_SIZES +
               "(16): emb x2, heads x4, mlp x4, layers x2")


def _megatron(name: str, h: int, layers: int, heads: int, tp: int, gpus: int, tflops: float) -> PublishedRun:
    mesh = {"data": gpus // tp, "tensor": tp} if tp > 1 else {"data": gpus}
    return PublishedRun(
        name=name, source=MEGATRON, profile="a100-80gb", devices=gpus, mesh=mesh, d_model=h, num_layers=layers,
        num_heads=heads, head_dim=h // heads, d_ff=swiglu_width(h), vocab=51200, seq_len=2048, global_batch=512,
        tie_embeddings=True, remat=True, published_tflops=tflops, source_flops=megatron_flops,
        notes="GPT (GELU 4h MLP, LayerNorm, learned positions, dropout) as ours (SwiGLU of equal flops, RMSNorm, "
              "RoPE, no dropout); pipeline size 1, data parallel over the rest")


RUNS: dict[str, PublishedRun] = {r.name: r for r in (
    _megatron("megatron-1.7b", 2304, 24, 24, 1, 32, 137.0),
    _megatron("megatron-3.6b", 3072, 30, 32, 2, 64, 138.0),
    _megatron("megatron-7.5b", 4096, 36, 32, 4, 128, 142.0),
    PublishedRun(
        name="maxtext-32b-v5p", source=MAXTEXT_V5P, profile="tpu-v5p", devices=64, mesh={"fsdp": 16, "tensor": 4},
        d_model=10240, num_layers=32, num_heads=32, head_dim=256, d_ff=21824,
        vocab=32768, seq_len=2048, global_batch=8 * 64, tie_embeddings=True, remat=False, published_tflops=328.0,
        source_flops=maxtext_flops,
        notes="v5p-128 is 64 chips (2 TensorCores each); remat_policy=minimal keeps the matmul outputs, taken as "
              "no rematerialisation; ReLU MLP of width 32768 as a SwiGLU of equal parameters (21824); flash "
              "attention there, materialised scores here"),
    PublishedRun(
        name="maxtext-16b-v5e", source=MAXTEXT_V5E, profile="tpu-v5e", devices=256, mesh={"fsdp": 256},
        d_model=5120, num_layers=32, num_heads=32, head_dim=256, d_ff=21824, vocab=32768, seq_len=2048,
        global_batch=6 * 256, tie_embeddings=True, remat=True, published_tflops=120.0, source_flops=maxtext_flops,
        notes="256 simulated devices: the slowest to compile here; ReLU MLP of width 32768 as a SwiGLU of equal "
              "parameters (21824); flash attention there, materialised scores here"),
)}

#: Independently measured maximum achievable bf16 matmul rate (flop/s) per profile: Stas Bekman, Machine
#: Learning Engineering, "Maximum Achievable Matmul FLOPS comparison table"
#: (https://github.com/stas00/ml-engineering, compute/accelerator/README.md), measured with mamf-finder.py.
ACHIEVABLE: dict[str, tuple[float, str]] = {
    "a100-80gb": (271.2e12, "A100 SXM MAMF 271.2 TFLOPS (86.9% of 312), torch 2.6.0+cu126"),
    "h100-sxm": (794.5e12, "H100 SXM MAMF 794.5 TFLOPS (80.3% of 989), torch 2.7.0+cu126"),
}


@dataclass(frozen=True)
class Prediction:
    """A run's estimate at its published depth: seconds per step (and its parts), peak bytes per device."""

    run: PublishedRun
    profile: str
    compute: float
    memory: float
    communication: float
    peak_bytes: float
    compile_seconds: float
    #: the sum of the kernels' rooflines (None: one roofline over the program), and the seconds of
    #: ``communication`` that run beside the compute (`multimesh.estimate.timing`)
    kernels: float | None = None
    overlapped: float = 0.0

    @property
    def step_time(self) -> float:
        from multimesh.estimate import ProgramTime

        return ProgramTime(self.compute, self.memory, self.communication, kernels=self.kernels,
                           overlapped=self.overlapped).total

    @property
    def serial_time(self) -> float:
        """Compute, memory traffic and collectives one after another: the pessimistic bound."""
        return self.compute + self.memory + self.communication

    @property
    def tflops(self) -> float:
        """Per device, in the source's FLOP count, had a step taken the predicted time."""
        return self.run.source_flops(self.run) / (self.run.devices * self.step_time) / 1e12

    @property
    def published_step_time(self) -> float:
        return self.run.source_flops(self.run) / (self.run.devices * self.run.published_tflops * 1e12)


def trainer_overrides(run: PublishedRun, layers: int, out_dir: str) -> list[str]:
    """The `tiny` config turned into ``run``'s model (at ``layers`` blocks), batch and layout."""
    mesh = "{" + ", ".join(f"{k}: {v}" for k, v in run.mesh.items()) + "}"
    return [
        f"model.d_model={run.d_model}", f"model.num_layers={layers}", f"model.num_heads={run.num_heads}",
        f"model.head_dim={run.head_dim}", f"model.num_kv_heads={run.num_kv_heads or run.num_heads}",
        f"model.d_ff={run.d_ff}", f"model.vocab_size={run.vocab}",
        f"model.max_len={run.seq_len}", f"model.tie_embeddings={str(run.tie_embeddings).lower()}",
        f"model.remat={str(run.remat).lower()}", "model.scan_layers=false",
        "model.dtype=bfloat16", "model.param_dtype=float32",
        f"data.seq_len={run.seq_len}", f"data.batch_size={run.global_batch}",
        f"data.max_bytes={40 * run.global_batch * (run.seq_len + 1)}",  # checked, never read: nothing is loaded
        f"layout.mesh={mesh}", "layout.pipeline=null", f"train.out_dir={out_dir}",
        f"train.grad_accum={run.grad_accum}",
        f"model.num_experts={run.num_experts}", f"model.experts_per_token={run.experts_per_token}",
        f"model.moe_capacity_factor={'null' if run.moe_capacity_factor is None else run.moe_capacity_factor}",
    ]


def _estimate(run: PublishedRun, layers: int, out_dir: str):
    """The run's `Estimate` (memory and work, no profile) at ``layers`` blocks."""
    import jax

    from trainers.config import load_config
    from trainers.plan_estimate import estimate_config

    cfg = load_config("tiny", trainer_overrides(run, layers, out_dir))
    return estimate_config(cfg, None, jax.devices()[:run.devices])


def compile_depths(run: PublishedRun) -> tuple[tuple, float]:
    """The run's estimates at 1 and 2 blocks, and the seconds they took (tracing and compiling)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        estimates = tuple(_estimate(run, n, out) for n in (1, 2))
    return estimates, time.perf_counter() - start


def predict(run: PublishedRun, estimates: tuple, profile, compile_seconds: float = 0.0) -> Prediction:
    """``run`` priced on ``profile`` (bfloat16 compute) from its ``estimates`` at 1 and 2 blocks, each part
    extrapolated linearly to the run's depth."""
    from multimesh.estimate import get_profile
    from multimesh.estimate.timing import program_time

    profile = get_profile(profile)
    times = []
    for e in estimates:
        (program,) = e.programs  # an SPMD step: one program
        times.append(program_time(program, profile, "bfloat16"))
    kernel_wise = all(t.kernels is not None for t in times)
    parts = [(t.compute, t.memory, t.communication, e.peak_bytes, t.kernels if kernel_wise else 0.0, t.overlapped)
             for t, e in zip(times, estimates)]
    extra = run.num_layers - 1
    *at_depth, kernels, overlapped = [a + extra * (b - a) for a, b in zip(*parts)]
    return Prediction(run, profile.name, *at_depth, compile_seconds=compile_seconds,
                      kernels=kernels if kernel_wise else None, overlapped=overlapped)


def achievable_profile(name: str):
    """The profile with its bfloat16 peak replaced by the measured maximum achievable matmul rate."""
    from multimesh.estimate import get_profile

    base = get_profile(name)
    rate, why = ACHIEVABLE[name]
    return dataclasses.replace(base, name=f"{name}@MAMF", peak_flops={**base.peak_flops, "bfloat16": rate},
                               achievable_matmul_fraction=1.0,
                               notes=(*base.notes, f"bfloat16 at the maximum achievable matmul rate: {why}"))


def _row(p: Prediction) -> str:
    from multimesh.estimate import get_profile

    r = p.run
    miss = p.tflops / r.published_tflops - 1
    peak = get_profile(r.profile).peak_flops["bfloat16"] / 1e12  # MFU against the datasheet, as sources do
    return (f"| {r.name} | {r.devices} {r.profile} | {', '.join(f'{k}={v}' for k, v in r.mesh.items())} | "
            f"{p.profile} | {p.step_time:.3f} s | {p.serial_time:.3f} s | {p.published_step_time:.3f} s | "
            f"{p.tflops:.0f} | "
            f"{r.published_tflops:.0f} | {p.tflops / peak:.0%} / {r.published_tflops / peak:.0%} | "
            f"{miss:+.0%} | {p.compute:.3f} / {p.memory:.3f} / {p.communication:.3f} | "
            f"{p.peak_bytes / 2**30:.1f} GiB |")


HEADER = ("| run | devices | layout | profile | predicted step | serial bound | published step | "
          "predicted TFLOP/s/dev | published | MFU predicted / published | miss | compute / memory / comm. (s) | "
          "peak/device |\n|" + "---|" * 13)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="*", default=list(RUNS), help=f"which runs (default all: {', '.join(RUNS)})")
    parser.add_argument("--list", action="store_true", help="print the runs and their sources, and exit")
    args = parser.parse_args()
    unknown = [n for n in args.runs if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; known: {', '.join(RUNS)}")
    runs = [RUNS[n] for n in args.runs]
    if args.list:
        for r in runs:
            print(f"{r.name}: {r.source}\n  {r.notes}")
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        sys.exit("fleet.py sets the simulated device count itself: unset XLA_FLAGS' "
                 "--xla_force_host_platform_device_count")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(r.devices for r in runs)}"
    import jax

    print(f"{jax.device_count()} simulated {jax.devices()[0].platform} devices, {os.cpu_count()} cores, "
          f"jax {jax.__version__}")
    print(HEADER)
    for r in runs:
        estimates, seconds = compile_depths(r)
        profiles = [r.profile] + ([achievable_profile(r.profile)] if r.profile in ACHIEVABLE else [])
        for prof in profiles:
            print(_row(predict(r, estimates, prof, seconds)) + f" <!-- built in {seconds:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
