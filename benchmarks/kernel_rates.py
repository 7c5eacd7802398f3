"""How fast a CPU host's devices run an elementwise pass: into a fresh output, in place, and transposed.

    python benchmarks/kernel_rates.py [--sizes 1 4 16] [--repeats 10]

On every device at once (8 simulated CPU devices by default), ``x * 2 + 1``
over a square array of each size (MiB per device): into a fresh output (what
`calibrate` times for the memory bandwidth), written in place (the input
donated), and transposed (the output in the other order, the input donated).
Bytes read and written per second per device, the best and the median of
``--repeats`` calls, and each pass's median time over the in-place pass's: the
rates a per-kernel roofline at one bandwidth takes as one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 4, 16], help="MiB per device (square arrays)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    n = mesh.size

    def on_each(fn, donate: bool):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")),
                       donate_argnums=0 if donate else ())

    def timed(fn, x: jax.Array, donate: bool) -> list[float]:
        times = []
        for i in range(args.repeats + 1):  # the first call compiles
            start = time.perf_counter()
            y = jax.block_until_ready(fn(x))
            times += [time.perf_counter() - start] if i else []
            x = y if donate else x  # a donated input is gone: its output is the next call's input
        return times

    passes = {"fresh": (lambda x: x * 2.0 + 1.0, False), "in place": (lambda x: x * 2.0 + 1.0, True),
              "transposed": (lambda x: jnp.swapaxes(x * 2.0 + 1.0, 1, 2), True)}
    print(f"{n} {jax.devices()[0].platform} devices, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          f"GB/s per device (best / median of {args.repeats}); time over the in-place pass's (medians)")
    for mib in args.sizes:
        side = int(np.sqrt((mib << 20) // 4))
        moved = 2 * side * side * 4
        made = jax.jit(lambda: jnp.ones((n, side, side), jnp.float32),
                       out_shardings=NamedSharding(mesh, P("d")))
        medians, cells = {}, []
        for name, (fn, donate) in passes.items():
            t = timed(on_each(fn, donate), made(), donate)
            medians[name] = statistics.median(t)
            cells.append(f"{name} {moved / min(t) / 1e9:5.2f} / {moved / medians[name] / 1e9:5.2f}")
        ratios = ", ".join(f"{k} {v / medians['in place']:4.2f}x" for k, v in medians.items() if k != "in place")
        print(f"{mib:3d} MiB ({side}^2): {' | '.join(cells)}; {ratios}", flush=True)


if __name__ == "__main__":
    main()
