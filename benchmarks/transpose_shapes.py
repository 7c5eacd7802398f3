"""The planner model's transposing kernels run alone, each at its own shape, against the calibrated rate.

    python benchmarks/transpose_shapes.py [--size large] [--repeats 12] [--top 25]

Compiles every candidate layout of `planner.py`'s model size (as its run
does, from abstract inputs) and reads each program's kernels. A kernel
transposes where one of its instructions is a ``transpose``, or a ``copy``
between layouts, whose element order is not the input's (size-1 dimensions
dropped, dimensions that stay together merged): its signature is the physical
input shape, the permutation, and how many fused parameters feed it (a
fusion reading 4 arrays at a stride reads 4 streams). Each signature is then
run alone on every device at once: those inputs combined elementwise and
transposed into a donated output, the inputs rotated among copies of at least
256 MiB in all so that they come from memory, not cache, as in a step. Its
time (median, less `calibrate`'s per-execution overhead) is printed against
the time its bytes take at `calibrate`'s elementwise rate, for the
signatures with the most bytes per step over all layouts.

Run 17 found the transposing copies take 3 times as long per byte in
one layout's step as in another's; this asks whether the kernels themselves
are slow at those shapes.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import planner  # noqa: E402

from multimesh.estimate import calibrate  # noqa: E402
from multimesh.estimate import programs as programs_module  # noqa: E402
from multimesh.estimate.hlo import Instruction, Module, parse_module  # noqa: E402

_SHAPE = re.compile(r"^\(?([a-z]+\d*)\[([\d,]*)\]\{([\d,]*)")
_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
Signature = tuple[str, tuple[int, ...], tuple[int, ...], int]  # dtype, physical input shape, permutation, inputs


def _dims_layout(shape: str) -> tuple[str, list[int], list[int]] | None:
    m = _SHAPE.match(shape.strip())
    if m is None:
        return None
    dims = [int(d) for d in m.group(2).split(",") if d]
    layout = [int(d) for d in m.group(3).split(",") if d]
    return (m.group(1), dims, layout) if len(layout) == len(dims) else None


def transposition(ins: Instruction, module: Module) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """(dtype, physical input shape, permutation) of a ``transpose`` or layout-changing ``copy`` whose
    element order differs from its input's, simplified; None for any other instruction."""
    if ins.opcode not in ("copy", "transpose") or not ins.operands:
        return None
    source, result = _dims_layout(module.shape(ins.operands[0])), _dims_layout(ins.shape)
    if source is None or result is None or result[0] not in _DTYPES:
        return None
    (_, dims, layout_in), (dtype, _, layout_out) = source, result
    logical = list(range(len(dims)))
    if ins.opcode == "transpose":
        m = re.search(r"dimensions=\{([\d,]*)\}", ins.attributes)
        logical = [int(d) for d in m.group(1).split(",")] if m else logical
    order_in = list(reversed(layout_in))  # major to minor, as logical input dimensions
    order_out = [logical[d] for d in reversed(layout_out)]
    position = {d: i for i, d in enumerate(order_in)}
    shape = [dims[d] for d in order_in]
    perm = [position[d] for d in order_out if dims[d] != 1]
    kept = sorted(perm)
    perm = [kept.index(p) for p in perm]
    shape = [shape[i] for i in kept]
    groups: list[list[int]] = []  # runs of input axes that stay adjacent and in order
    for p in perm:
        if groups and groups[-1][-1] + 1 == p:
            groups[-1].append(p)
        else:
            groups.append([p])
    by_start = sorted(range(len(groups)), key=lambda g: groups[g][0])
    merged = tuple(math.prod(shape[i] for i in groups[g]) for g in by_start)
    new_perm = tuple(by_start.index(g) for g in range(len(groups)))
    return None if new_perm == tuple(sorted(new_perm)) else (dtype, merged, new_perm)


def _inputs(ins: Instruction, body: tuple[Instruction, ...]) -> int:
    """How many fused parameters feed ``ins`` (through the fusion's elementwise instructions)."""
    by_name = {f.name: f for f in body}
    seen, stack, count = set(), list(ins.operands[:1]), 0
    while stack:
        name = stack.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        f = by_name[name]
        if f.opcode == "parameter":
            count += 1
        elif f.opcode not in ("constant", "iota"):
            stack.extend(f.operands)
    return max(count, 1)


def signatures(hlo: str) -> Counter[Signature]:
    """Each transposing kernel's signature in a compiled program, with its executions per run."""
    module = parse_module(hlo)
    found: Counter[Signature] = Counter()
    for ins, times in module.executed(("body", "condition", "branch", "call")):
        m = re.search(r"\bcalls=%?([\w.\-]+)", ins.attributes) if ins.opcode == "fusion" else None
        body = module.computations.get(m.group(1), ()) if m else (ins,)
        for f in body:
            t = transposition(f, module)
            if t is not None:
                found[(*t, _inputs(f, body) if m else 1)] += times
    return found


def layouts_signatures(size: str) -> Counter[Signature]:
    """Every signature over the size's candidate layouts, weighted by executions per step."""
    from trainers.config import load_config
    from trainers.step import program_for

    texts: list[tuple[str, int]] = []
    analyse = programs_module.analyse_compiled

    def keep(name, compiled, mesh, executions=1, matmuls=0.0):  # the estimate's own compilations
        texts.append((compiled.as_text(), executions))
        return analyse(name, compiled, mesh, executions, matmuls)

    programs_module.analyse_compiled = keep
    layouts = planner.candidates()
    layouts = planner.large_subset(layouts) if size == "large" else layouts
    total: Counter[Signature] = Counter()
    try:
        for layout in layouts:
            cfg = load_config("tiny", [*planner.SIZES[size], *planner.QUIET, *planner.overrides(layout)])
            program = program_for(cfg)
            with program.layout.tasks(cfg.model.num_layers, cfg.model.scan_layers):
                program.step.estimate()
            for text, executions in texts:
                for sig, n in signatures(text).items():
                    total[sig] += n * executions
            texts.clear()
    finally:
        programs_module.analyse_compiled = analyse
    return total


def time_alone(sig: Signature, mesh: Mesh, repeats: int) -> float:
    """Seconds one execution of the signature's kernel takes on every device at once, inputs from memory."""
    dtype, shape, perm, inputs = sig
    n = mesh.size
    spread = NamedSharding(mesh, P("d"))
    per_set = n * (inputs + 1) * math.prod(shape) * jnp.dtype(_DTYPES[dtype]).itemsize
    copies = max(1, -(-(256 << 20) // per_set))
    sets = [[jax.device_put(np.full((n, *shape), 1.0 + i + c, _DTYPES[dtype]), spread) for i in range(inputs)]
            for c in range(copies)]
    out = jax.device_put(np.zeros((n, *(shape[p] for p in perm)), _DTYPES[dtype]), spread)

    def kernel(_, *xs):
        y = xs[0]
        for j, x in enumerate(xs[1:]):
            y = y * x if j % 2 == 0 else y + x
        return jnp.transpose(y, (0, *(p + 1 for p in perm)))

    fn = jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=(P("d"),) * (inputs + 1), out_specs=P("d")),
                 donate_argnums=0, keep_unused=True)
    times = []
    for i in range(repeats + 2):  # two warm-up calls (compile)
        start = time.perf_counter()
        out = jax.block_until_ready(fn(out, *sets[i % copies]))
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="large", choices=list(planner.SIZES))
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--top", type=int, default=25, help="the signatures with the most bytes per step")
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    start = time.perf_counter()
    profile = calibrate()
    found = layouts_signatures(args.size)
    print(f"{mesh.size} {jax.devices()[0].platform} devices, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; calibrated {profile.memory_bandwidth:.3g} B/s elementwise, "
          f"{profile.launch_overhead * 1e6:.0f} us per execution; {len(found)} transposing signatures over "
          f"the {args.size} size's layouts")

    def moved(sig: Signature) -> int:
        return (sig[3] + 1) * math.prod(sig[1]) * jnp.dtype(_DTYPES[sig[0]]).itemsize

    print(f"{'dtype, physical input shape, permutation, inputs':52s} {'per step':>8s} {'MiB':>6s} {'alone us':>8s} "
          f"{'GB/s':>6s} {'x calibrated':>12s}")
    rates = []
    for sig in sorted(found, key=lambda s: -moved(s) * found[s])[:args.top]:
        seconds = time_alone(sig, mesh, args.repeats) - profile.launch_overhead
        head = f"{str(sig):52s} {found[sig]:8d} {moved(sig) / 2**20:6.2f} {seconds * 1e6:8.0f}"
        if seconds < 0.25 * profile.launch_overhead:  # within the noise of the execution's own cost
            print(f"{head}   (within the per-execution overhead)", flush=True)
            continue
        rate = moved(sig) / seconds
        rates.append(rate)
        print(f"{head} {rate / 1e9:6.2f} {profile.memory_bandwidth / rate:12.2f}", flush=True)
    print(f"median {statistics.median(rates) / 1e9:.2f} GB/s over {len(rates)} signatures, calibrated "
          f"{profile.memory_bandwidth / 1e9:.2f}; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
