"""Step time from a hardware profile: a roofline per program and an alpha-beta model per collective.

A program takes ``max(flops / peak, bytes accessed / memory bandwidth)`` plus
its collectives, which are not assumed to overlap with compute, plus the
profile's ``launch_overhead`` (a `CalibratedProfile`'s measured cost of one
execution whatever its work; 0 for a datasheet profile). A copy between
submeshes costs its fixed cost (``transfer_time``) and its bytes over the
link. A collective over ``n`` devices moving ``B`` bytes (ring algorithms) takes
``steps * latency + factor * B / bandwidth``:

=====================  =========  ===========================
kind                   steps      factor (B: result bytes)
=====================  =========  ===========================
all-reduce             2(n-1)     2(n-1)/n
all-gather             n-1        (n-1)/n
reduce-scatter         n-1        n-1 (the input is n * B)
all-to-all             n-1        (n-1)/n
collective-permute     1          1
=====================  =========  ===========================

with the intra-node link when the group fits in a node
(``devices_per_node``), else the inter-node one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .collectives import Collective
from .profiles import HardwareProfile
from .programs import ProgramCost

__all__ = ["ProgramTime", "collective_time", "launch_overhead", "program_time", "transfer_time"]


def collective_time(c: Collective, profile: HardwareProfile) -> float:
    n = max(c.group_size, 1)
    if n == 1:
        return 0.0
    inside = n <= profile.devices_per_node
    bandwidth = profile.intra_node_bandwidth if inside else profile.inter_node_bandwidth
    latency = profile.intra_node_latency if inside else profile.inter_node_latency
    steps, factor = {
        "all-reduce": (2 * (n - 1), 2 * (n - 1) / n),
        "all-gather": (n - 1, (n - 1) / n),
        "reduce-scatter": (n - 1, n - 1),
        "all-to-all": (n - 1, (n - 1) / n),
        "collective-permute": (1, 1.0),
    }[c.kind]
    return steps * latency + factor * c.bytes / bandwidth


@dataclass(frozen=True)
class ProgramTime:
    """One execution of a program, in seconds: ``compute`` (flops at peak), ``memory`` (bytes at the memory
    bandwidth), ``communication`` (its collectives), ``launch`` (the execution's fixed cost);
    ``total`` = launch + work, ``work`` = max(compute, memory) + communication."""

    compute: float
    memory: float
    communication: float
    launch: float = 0.0

    @property
    def work(self) -> float:
        return max(self.compute, self.memory) + self.communication

    @property
    def total(self) -> float:
        return self.launch + self.work


def launch_overhead(profile: HardwareProfile) -> float:
    """Seconds one program execution costs whatever its work: measured by `calibrate`, else 0."""
    return profile.launch_overhead


def program_time(p: ProgramCost, profile: HardwareProfile, dtype: str) -> ProgramTime:
    return ProgramTime(compute=p.flops / profile.flops_rate(dtype),
                       memory=p.bytes_accessed / profile.memory_bandwidth,
                       communication=sum(c.count * collective_time(c, profile) for c in p.collectives),
                       launch=launch_overhead(profile))


def transfer_time(nbytes: int, profile: HardwareProfile, *, inside_node: bool) -> float:
    """One copy between submeshes: its fixed cost (the link's latency, or the profile's measured
    ``copy_latency`` where that is more) + bytes / link bandwidth."""
    if inside_node:
        return max(profile.copy_latency, profile.intra_node_latency) + nbytes / profile.intra_node_bandwidth
    return max(profile.copy_latency, profile.inter_node_latency) + nbytes / profile.inter_node_bandwidth
