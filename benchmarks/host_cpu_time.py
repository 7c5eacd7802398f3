"""Where a step's time goes when simulated devices share a host's cores: CPU time, idle cores, page faults.

    python benchmarks/host_cpu_time.py [--size large] [--rounds 6] [--steps 3] [--layouts "fsdp=8" ...]

For each layout of `planner.py` (its candidates of ``--size``; for the large
size its usual subset), built as that benchmark builds it, ``--rounds`` rounds
of ``--steps`` steps, the rounds of all layouts interleaved; per step, the
median over the rounds of: the wall time, the process's user and kernel
(sys) CPU time, the share of the cores left idle (1 - CPU / (cores x wall)),
and the minor page faults. A layout whose step waits on a laggard device
thread idles cores; one whose kernels are slower burns more CPU: this tells
the two apart, which a step's wall time alone cannot. Linux (getrusage).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

import planner  # sets XLA_FLAGS for 8 devices before JAX is imported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="large", choices=list(planner.SIZES))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", nargs="*", default=None, help="layouts by their description (default: all)")
    args = parser.parse_args()
    layouts = planner.candidates()
    if args.size == "large":
        layouts = planner.large_subset(layouts)
    if args.layouts:
        layouts = [lay for lay in layouts if lay.describe() in args.layouts]
    cores = len(os.sched_getaffinity(0))
    print(f"{args.size}: {len(layouts)} layouts, {cores} cores, load average {os.getloadavg()[0]:.2f}; median of "
          f"{args.rounds} rounds of {args.steps} steps", flush=True)
    size = planner.SIZES[args.size]
    state = {planner.size_key(size): planner.host_state(size)}
    with tempfile.TemporaryDirectory() as tmp:
        built = [(lay, planner.Built(size, lay, {}, f"{tmp}/{i}", state)) for i, lay in enumerate(layouts)]
        seen: dict[str, list[tuple[float, float, float, float]]] = {lay.describe(): [] for lay in layouts}
        for r in range(args.rounds):
            for lay, b in built if r % 2 == 0 else built[::-1]:
                before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                b.timed(args.steps)
                wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
                seen[lay.describe()].append(tuple(x / args.steps for x in (
                    wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                    after.ru_minflt - before.ru_minflt)))
    print(f"{'layout':60s} {'wall ms':>8s} {'user ms':>8s} {'sys ms':>7s} {'idle':>5s} {'faults':>8s}")
    for name, runs in sorted(seen.items(), key=lambda kv: statistics.median(r[0] for r in kv[1])):
        wall, user, sys_, faults = (statistics.median(r[i] for r in runs) for i in range(4))
        print(f"{name:60s} {wall * 1e3:8.1f} {user * 1e3:8.1f} {sys_ * 1e3:7.1f} "
              f"{1 - (user + sys_) / (cores * wall):5.2f} {faults:8.0f}")


if __name__ == "__main__":
    main()
