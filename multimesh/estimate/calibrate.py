"""A `HardwareProfile` of the devices at hand, measured with every device busy at once.

Four short measurements, each the best of ``repeats`` timed runs after one
warm-up: a matrix product per device (flop/s), an elementwise pass over a
large array per device (bytes read and written per second), and an
all-reduce over all devices of a tiny and of a large array (latency, and
bandwidth by the ring model of `timing.collective_time`). On one host every
link is the same, so the intra- and inter-node figures are equal and the
node holds all the devices measured.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .profiles import HardwareProfile

__all__ = ["calibrate"]


def _best(fn: Callable, arg: Any, repeats: int) -> float:
    jax.block_until_ready(fn(arg))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(arg))
        best = min(best, time.perf_counter() - start)
    return best


def _memory_bytes(devices: Sequence[Any]) -> int:
    """The device's own limit where it reports one, else the host's memory shared by its local devices."""
    stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(host // max(1, len([d for d in devices if d.process_index == devices[0].process_index])))


def calibrate(devices: Sequence[Any] | None = None, *, matmul_size: int = 512, copy_bytes: int = 16 << 20,
              collective_bytes: int = 4 << 20, repeats: int = 5, dtype: Any = jnp.float32) -> HardwareProfile:
    """Measure the ``devices`` (default: all) and return their profile, named ``calibrated-<platform>``.

    ``matmul_size``: the side of each device's square matrices; ``copy_bytes``
    and ``collective_bytes``: per device; ``dtype``: of the matrix product
    (its peak is recorded under that dtype's name and, when none other is,
    under ``float32`` too).
    """
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    spread = NamedSharding(mesh, P("d"))

    def on_each(fn: Callable) -> Callable:
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    k = matmul_size
    mats = jax.device_put(jnp.ones((n * k, k), dtype), spread)
    t_matmul = _best(on_each(lambda x: x @ x), mats, repeats)  # each device: (k, k) @ (k, k)
    rate = 2 * k ** 3 / t_matmul

    words = max(1, copy_bytes // 4)
    big = jax.device_put(jnp.ones((n * words,), jnp.float32), spread)
    t_copy = _best(on_each(lambda x: x * 2.0 + 1.0), big, repeats)
    bandwidth = 2 * words * 4 / t_copy  # read once, written once

    def summed(x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, "d")

    tiny = jax.device_put(jnp.ones((n,), jnp.float32), spread)
    t_tiny = _best(on_each(summed), tiny, repeats)
    words = max(1, collective_bytes // 4)
    large = jax.device_put(jnp.ones((n * words,), jnp.float32), spread)
    t_large = _best(on_each(summed), large, repeats)
    steps = 2 * (n - 1) if n > 1 else 1
    latency = t_tiny / steps
    link = (2 * (n - 1) / n if n > 1 else 1.0) * words * 4 / max(t_large - t_tiny, 1e-9)

    name = np.dtype(dtype).name
    peaks = {name: rate}
    peaks.setdefault("float32", rate)
    return HardwareProfile(
        name=f"calibrated-{devices[0].platform}", peak_flops=peaks, memory_bandwidth=bandwidth,
        memory_bytes=_memory_bytes(devices), intra_node_bandwidth=link, intra_node_latency=latency,
        inter_node_bandwidth=link, inter_node_latency=latency, devices_per_node=n,
        source=f"measured by multimesh.estimate.calibrate on {n} {devices[0].device_kind} devices",
        notes=("measured with every device busy; one host: inter-node figures are the intra-node ones",))
