"""Do programs on disjoint simulated CPU devices run at once, or one after another? (issue 24's time model)

    python benchmarks/host_sharing.py [--devices 8] [--rounds 7]

The planner (`multimesh.estimate.steptime`) times a pipeline on devices that
share a host's cores as every program in turn. This measures why: the same
programs (``tanh(x @ x) @ x`` per device, of a few sizes) on 2 or 4 groups of
the devices, each group alone one after the other, against all groups
dispatched together before waiting. A ratio (together / in turn) near 1 says
the host's cores run them no faster together; well below 1, that they overlap.
Best of ``--rounds`` timings each.

Then what an all-reduce costs while the devices are busy: a chain of 16
matrix products per device with an all-reduce after each (over all the
devices, or a group of 4 or 2) against the same chain without them; the
extra time per all-reduce, and per step of the ring model (``2 (n - 1)``
steps), to set beside the latency `calibrate` measures on idle devices.
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
    collectives_while_busy(args.rounds)


def collectives_while_busy(rounds: int, chain: int = 16) -> None:
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(len(devices) // 2, 2), ("a", "b"))
    print(f"\nan all-reduce after each of {chain} matrix products per device (extra time per all-reduce):")
    print(f"{'matrix':>6s} {'over':>8s} {'alone ms':>9s} {'per all-reduce us':>17s} {'per ring step us':>16s}")
    for size in (64, 128):
        x = jax.jit(lambda: jnp.ones((len(devices) * size, size)),
                    out_shardings=NamedSharding(mesh, P(("a", "b"))))()

        def program(axes):
            def body(x):
                for _ in range(chain):
                    x = jnp.tanh(x @ x) * 0.5
                    if axes:
                        x = jax.lax.psum(x, axes) * 0.1
                return x
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b"))))
            jax.block_until_ready(fn(x))
            return lambda: jax.block_until_ready(fn(x))

        alone = best(program(()), rounds)
        for axes in (("a", "b"), ("a",), ("b",)):
            n = int(np.prod([mesh.shape[a] for a in axes]))
            extra = (best(program(axes), rounds) - alone) / chain
            print(f"{size:6d} {n:4d} dev {alone * 1e3:9.2f} {extra * 1e6:17.0f} {extra / (2 * (n - 1)) * 1e6:16.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
