"""Do programs on disjoint simulated CPU devices run at once, or one after another? (issue 24's time model)

    python benchmarks/host_sharing.py [--devices 8] [--rounds 7]

The planner (`multimesh.estimate.steptime`) times a pipeline on devices that
share a host's cores as every program in turn. This measures why: the same
programs (``tanh(x @ x) @ x`` per device, of a few sizes) on 2 or 4 groups of
the devices, each group alone one after the other, against all groups
dispatched together before waiting. A ratio (together / in turn) near 1 says
the host's cores run them no faster together; well below 1, that they overlap.
Best of ``--rounds`` timings each.
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


def best(call, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    devices = jax.devices()
    n = len(devices)
    print(f"{n} {devices[0].platform} devices, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print(f"{'matrix':>6s} {'groups':>10s} {'in turn ms':>10s} {'together ms':>11s} {'ratio':>6s}")
    for size in (128, 256, 512):
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


if __name__ == "__main__":
    main()
