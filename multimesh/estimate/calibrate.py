"""A `CalibratedProfile` of the devices at hand, measured with every device busy at once.

Short measurements, each the best of ``repeats`` timed runs after one
warm-up: a program doing next to nothing on every device (the cost of one
program execution whatever its work: dispatch, thread hand-offs), a matrix
product per device (flop/s), the same product on 1, 2, ... of the devices
while the others idle (how much faster they compute than with all busy:
simulated CPU devices share the host's cores), an elementwise pass over a
large array per device (bytes read and written per second), the same pass
with an output above the allocator's mapping threshold, faulted in afresh on
every call or not (`fresh_memory_rate`), all-reduces over
all devices (a chain of tiny ones in one program: latency; a large one:
bandwidth by the ring model of `timing.collective_time`), and a copy of a
tiny array between two devices. The execution cost is taken out of the
collectives' latency (a tiny all-reduce is mostly that cost), so that the
time model counts it once per program; the other measurements are sized for
their work to dominate it. On one host every link is the same, so the
intra- and inter-node figures are equal and the node holds all the devices
measured. The arrays are made by a program with the target sharding (not
copied from the host), so devices of several processes calibrate together;
then the processes agree on one profile (`_slowest`): each rate the slowest
process measured, each fixed cost the largest, so that a plan or a layout
search made from it is the same on every process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .profiles import HardwareProfile
from .timing import FRESH_MAPPING_BYTES

__all__ = ["CalibratedProfile", "calibrate"]


@dataclass(frozen=True)
class CalibratedProfile(HardwareProfile):
    """A `HardwareProfile` measured by `calibrate`, with the figures datasheets do not give.

    ``launch_overhead``: seconds one program execution costs whatever its
    work (on a GPU a few microseconds, negligible; on simulated CPU devices a
    synchronisation of the host's threads). ``copy_latency``: one copy of a
    tiny array between two devices (the dispatch of a transfer). ``alone_speedup``
    and ``busy_speedup``: how much faster devices compute while others idle:
    1 where each device has its own compute, up to the device count where the
    devices share a host's cores (then a pipeline stage running alone gets the
    idle stages' share). XLA:CPU runs matrix products faster on fewer device
    threads, so ``k * speed-up`` can exceed the device count; the time model
    takes no more than the host's share (`steptime`). ``fresh_memory_rate``:
    bytes/s per device at which a program's temporaries are first touched
    where the allocator maps them afresh each execution (0: it reuses them).
    """


_CHAIN = 16  # tiny all-reduces per latency measurement
_RESOLUTION = time.get_clock_info("perf_counter").resolution


def _best(fn: Callable, arg: Any, repeats: int) -> float:
    jax.block_until_ready(fn(arg))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(arg))
        best = min(best, time.perf_counter() - start)
    return best


def _memory_bytes(devices: Sequence[Any]) -> int:
    """A device's own limit where it reports one, else the host's memory shared by its local devices (only
    this process's devices can be asked)."""
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices[:1])
    stats = local[0].memory_stats() if hasattr(local[0], "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(host // max(1, len(local)))


def _copy_latency(local: Sequence[Any], repeats: int) -> float:
    """The best time of one copy of a tiny array from one of this process's devices to another (0 with one)."""
    if len(local) < 2:
        return 0.0
    tiny = jax.device_put(np.zeros((16,), np.float32), local[0])
    jax.block_until_ready(jax.device_put(tiny, local[1]))
    best = float("inf")
    for _ in range(max(repeats, 5)):
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(tiny, local[1]))
        best = min(best, time.perf_counter() - start)
    return best


def _minor_faults() -> int | None:
    try:
        import resource
    except ImportError:  # not on this OS: no page faults counted, none priced
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _fresh_memory_rate(pass_: Callable, in_place: Callable, big: jax.Array, local: int, repeats: int) -> float:
    """Bytes/s per device at which ``pass_``'s fresh output (above `FRESH_MAPPING_BYTES` per device) is first
    touched: its time over the same pass written in place, where the allocator maps that output afresh on
    every call (most of its pages faulted in each time); 0 where it reuses them (no such page faults)."""
    per_device = big.nbytes // len(big.sharding.device_set)
    for _ in range(2):  # compiled, and a heap that keeps freed memory grown to hold it
        jax.block_until_ready(pass_(big))
    before = _minor_faults()
    t_fresh = _best(pass_, big, repeats)
    after = _minor_faults()
    if before is None or after is None:
        return 0.0
    pages = local * per_device / os.sysconf("SC_PAGE_SIZE")
    if (after - before) / (repeats + 1) < 0.5 * pages:  # `_best`'s own warm-up call included
        return 0.0
    x = jax.block_until_ready(in_place(big))  # consumes big
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = jax.block_until_ready(in_place(x))
        best = min(best, time.perf_counter() - start)
    return per_device / (t_fresh - best) if t_fresh > best else 0.0


#: The figures `_slowest` agrees on: rates (the slowest process's is kept: the least) and costs (the most).
_RATES = ("flops", "memory_bandwidth", "link", "memory_bytes")
_COSTS = ("launch", "latency", "copy_latency")


def _slowest(figures: dict[str, float], mesh: Mesh) -> dict[str, float]:
    """``figures`` as every process owning ``mesh``'s devices measured them, made one: each of `_RATES` the
    least, each of `_COSTS` the most, ``fresh_memory_rate`` the least above 0 (0: no process's allocator maps
    temporaries afresh). A step runs at its slowest process's pace, and processes that plan from different
    profiles could choose different layouts. One program over the mesh (only its processes take part), in
    float32: the figures agree to 7 digits, the memory to the MiB."""
    if len({d.process_index for d in mesh.devices.flat}) < 2:
        return figures
    mib = float(1 << 20)
    names = [*_RATES, "fresh_memory_rate", *_COSTS]
    mine = {**figures, "memory_bytes": figures["memory_bytes"] // mib,  # whole MiB: exact in float32
            "fresh_memory_rate": figures["fresh_memory_rate"] or np.inf}  # 0 (none seen) never the least
    everywhere = np.broadcast_to(np.array([[mine[k] for k in names]], np.float32), (mesh.devices.size, len(names)))
    rows = jax.make_array_from_callback(  # every device of this process holds this process's figures
        everywhere.shape, NamedSharding(mesh, P("d")), lambda index: everywhere[index])
    least, most = jax.jit(jax.shard_map(lambda x: (jax.lax.pmin(x, "d"), jax.lax.pmax(x, "d")), mesh=mesh,
                                        in_specs=P("d"), out_specs=(P(), P())))(rows)
    least, most = (np.asarray(a.addressable_data(0))[0].astype(float) for a in (least, most))
    agreed = {k: float(least[i] if k in _RATES or k == "fresh_memory_rate" else most[i]) for i, k in enumerate(names)}
    agreed["memory_bytes"] *= mib
    if not np.isfinite(agreed["fresh_memory_rate"]):
        agreed["fresh_memory_rate"] = 0.0
    return agreed


def _made(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.Array:
    """Ones of ``shape`` made in place with ``sharding`` (works when the devices span processes)."""
    return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=sharding)()


def calibrate(devices: Sequence[Any] | None = None, *, matmul_size: int = 512, copy_bytes: int = 16 << 20,
              collective_bytes: int = 4 << 20, fresh_bytes: int = FRESH_MAPPING_BYTES + (16 << 20),
              repeats: int = 5, dtype: Any = jnp.float32) -> CalibratedProfile:
    """Measure the ``devices`` (default: all) and return their profile, named ``calibrated-<platform>``.

    ``matmul_size``: the side of each device's square matrices; ``copy_bytes``,
    ``fresh_bytes`` (at most `FRESH_MAPPING_BYTES`: no fresh memory measured)
    and ``collective_bytes``: per device; ``dtype``: of the matrix product
    (its peak is recorded under that dtype's name and, when none other is,
    under ``float32`` too).
    """
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    spread = NamedSharding(mesh, P("d"))

    def on_each(fn: Callable, donate: bool = False) -> Callable:
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")),
                       donate_argnums=0 if donate else ())

    def doubled(x: jax.Array) -> jax.Array:  # an elementwise pass: each element read once, written once
        return x * 2.0 + 1.0

    elementwise = on_each(doubled)  # a fresh output per call

    tiny = _made((n,), jnp.float32, spread)
    launch = _best(on_each(lambda x: x + 1.0), tiny, repeats)

    def after_launch(seconds: float) -> float:
        return max(seconds - launch, 0.0)

    k = matmul_size
    mats = _made((n * k, k), dtype, spread)
    t_matmul = _best(on_each(lambda x: x @ x), mats, repeats)  # each device: (k, k) @ (k, k)
    rate = 2 * k ** 3 / t_matmul
    busy_speedup: dict[int, float] = {n: 1.0}
    local = [d for d in devices if d.process_index == jax.process_index()]
    # only this process's devices can be left idle while some compute: across processes (each its own
    # cores) nothing is shared that one process could measure, and the speed-ups stay 1
    for busy in (b for b in range(1, n) if n % b == 0 and len(local) == n):
        part = Mesh(np.array(local[:busy]), ("d",))  # the same product on `busy` devices, the others idle
        some = NamedSharding(part, P("d"))

        def on_part(fn: Callable, part: Mesh = part) -> Callable:
            return jax.jit(jax.shard_map(fn, mesh=part, in_specs=P("d"), out_specs=P("d")))

        t_busy = _best(on_part(lambda x: x @ x), _made((busy * k, k), dtype, some), repeats)
        busy_speedup[busy] = t_matmul / t_busy
    alone_speedup = min(float(n), max(1.0, busy_speedup.get(1, 1.0)))

    words = max(1, copy_bytes // 4)
    big = _made((n * words,), jnp.float32, spread)
    t_copy = _best(elementwise, big, repeats)
    bandwidth = 2 * words * 4 / t_copy
    fresh_rate = 0.0
    if fresh_bytes > FRESH_MAPPING_BYTES:
        fresh = _made((n * max(1, fresh_bytes // 4),), jnp.float32, spread)
        fresh_rate = _fresh_memory_rate(elementwise, on_each(doubled, donate=True), fresh, len(local), repeats)
        del fresh

    def summed(x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, "d")

    def chained(x: jax.Array) -> jax.Array:  # dependent all-reduces: one execution's cost spread over them
        for _ in range(_CHAIN):
            x = jax.lax.psum(x, "d") * 0.5
        return x

    # one tiny all-reduce's own time; at least the timer's resolution, for a host where it is within noise
    t_tiny = max(after_launch(_best(on_each(chained), tiny, repeats)) / _CHAIN, _RESOLUTION)
    words = max(1, collective_bytes // 4)
    large = _made((n * words,), jnp.float32, spread)
    t_large = _best(on_each(summed), large, repeats)
    steps = 2 * (n - 1) if n > 1 else 1
    latency = t_tiny / steps
    link = (2 * (n - 1) / n if n > 1 else 1.0) * words * 4 / max(t_large - launch - t_tiny, 1e-9)

    f = _slowest({"flops": rate, "memory_bandwidth": bandwidth, "link": link,
                  "memory_bytes": _memory_bytes(devices), "fresh_memory_rate": fresh_rate,
                  "launch": launch, "latency": latency, "copy_latency": _copy_latency(local, repeats)}, mesh)
    name = np.dtype(dtype).name
    peaks = {name: f["flops"]}
    peaks.setdefault("float32", f["flops"])
    return CalibratedProfile(
        name=f"calibrated-{devices[0].platform}", platform=devices[0].platform, peak_flops=peaks,
        memory_bandwidth=f["memory_bandwidth"], memory_bytes=int(f["memory_bytes"]),
        intra_node_bandwidth=f["link"], intra_node_latency=f["latency"], inter_node_bandwidth=f["link"],
        inter_node_latency=f["latency"], devices_per_node=n,
        source=f"measured by multimesh.estimate.calibrate on {n} {devices[0].device_kind} devices",
        notes=("measured with every device busy; one host: inter-node figures are the intra-node ones",),
        launch_overhead=f["launch"], copy_latency=f["copy_latency"], alone_speedup=alone_speedup,
        busy_speedup=tuple(sorted(busy_speedup.items())), fresh_memory_rate=f["fresh_memory_rate"])
