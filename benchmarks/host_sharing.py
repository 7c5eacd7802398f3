"""Do programs on disjoint simulated CPU devices run at once, or one after another? (the planner's time model)

    python benchmarks/host_sharing.py [--devices 8] [--rounds 7]

The planner (`multimesh.estimate.steptime`) times a pipeline on devices that
share a host's cores as every program in turn. This measures why: the same
programs (``tanh(x @ x) @ x`` per device, of a few sizes) on 2 or 4 groups of
the devices, each group alone one after the other, against all groups
dispatched together before waiting. A ratio (together / in turn) near 1 says
the host's cores run them no faster together; well below 1, that they overlap.
Best of ``--rounds`` timings each.

Then what an all-reduce costs while the devices are busy: a chain of 8
matrix products per device with a tiny all-reduce after each (over all the
devices, or a group of 4 or 2) against the same chain without them; the
extra time per all-reduce, for matrices of ``--lag-sizes`` (longer stretches
of compute between), beside the same all-reduces back to back (what
`calibrate`'s latency measures). Medians of ``--rounds``.

    python benchmarks/host_sharing.py --lag-only --rounds 15
"""

from __future__ import annotations

import argparse
import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def on_group(devices: list, size: int):
    """A program on ``devices`` and its input (a ``size`` x ``size`` matrix per device)."""
    mesh = Mesh(np.array(devices), ("d",))
    fn = jax.jit(jax.shard_map(lambda x: jnp.tanh(x @ x) @ x, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jax.jit(lambda: jnp.ones((len(devices) * size, size)), out_shardings=NamedSharding(mesh, P("d")))()
    jax.block_until_ready(fn(x))
    return fn, x


def timings(call, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def best(call, rounds: int) -> float:
    return min(timings(call, rounds))


def median(call, rounds: int) -> float:
    return float(np.median(timings(call, rounds)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--lag-sizes", type=int, nargs="+", default=[64, 128, 256, 384, 512],
                        help="matrix sides for the all-reduce-after-compute table (longer compute between)")
    parser.add_argument("--lag-only", action="store_true", help="only the all-reduce-after-compute table")
    args = parser.parse_args()
    devices = jax.devices()
    n = len(devices)
    print(f"{n} {devices[0].platform} devices, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print(f"{'matrix':>6s} {'groups':>10s} {'in turn ms':>10s} {'together ms':>11s} {'ratio':>6s}")
    for size in () if args.lag_only else (128, 256, 512):
        for groups in (2, 4):
            per = n // groups
            programs = [on_group(devices[g * per:(g + 1) * per], size) for g in range(groups)]

            def in_turn():
                for fn, x in programs:
                    jax.block_until_ready(fn(x))

            def together():
                jax.block_until_ready([fn(x) for fn, x in programs])

            a, b = best(in_turn, args.rounds), best(together, args.rounds)
            print(f"{size:6d} {groups:3d} of {per:3d} {a * 1e3:10.2f} {b * 1e3:11.2f} {b / a:6.2f}", flush=True)
    collectives_while_busy(args.rounds, tuple(args.lag_sizes))


def collectives_while_busy(rounds: int, sizes: tuple[int, ...], chain: int = 8) -> None:
    """A tiny all-reduce after each of ``chain`` matrix products per device, against the chain alone: what
    one costs after a stretch of compute (the last device thread's lag), beside a chain of tiny all-reduces
    back to back (what `calibrate`'s latency sees). Medians of ``rounds``."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(len(devices) // 2, 2), ("a", "b"))
    spec = P(("a", "b"))
    print(f"\na tiny all-reduce after each of {chain} matrix products per device, all devices busy "
          f"(median of {rounds}):")
    print(f"{'matrix':>6s} {'over':>8s} {'compute between ms':>18s} {'per all-reduce us':>17s} "
          f"{'back to back us':>15s} {'ratio':>6s}")
    for size in sizes:
        x = jax.jit(lambda: jnp.ones((len(devices) * size, size)), out_shardings=NamedSharding(mesh, spec))()

        def program(axes, compute=True):
            def body(x):
                for _ in range(chain):
                    if compute:
                        x = jnp.tanh(x @ x) * 0.5
                    if axes:  # a tiny one: its bytes cost nothing, its synchronisation is what is timed
                        x = x + jax.lax.psum(x[:1, :1], axes) * 0.0
                return x
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
            jax.block_until_ready(fn(x))
            return lambda: jax.block_until_ready(fn(x))

        alone = median(program(()), rounds)
        for axes in (("a", "b"), ("a",), ("b",)):
            n = int(np.prod([mesh.shape[a] for a in axes]))
            extra = (median(program(axes), rounds) - alone) / chain
            back_to_back = median(program(axes, compute=False), rounds) / chain
            print(f"{size:6d} {n:4d} dev {alone / chain * 1e3:18.2f} {extra * 1e6:17.0f} {back_to_back * 1e6:15.0f} "
                  f"{extra / back_to_back:6.2f}", flush=True)


if __name__ == "__main__":
    main()
