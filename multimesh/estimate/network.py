"""How long one collective takes over a cluster as it is wired: NVLink (or ICI) inside a node, NICs between nodes.

A collective's group of ``n`` devices spans ``m`` nodes with at most ``g``
of its devices on one node (`Span`). Inside one node (``m == 1``) it is a
ring over the intra-node link. Across nodes, every device of a node runs the
same collective at once (an SPMD program: the node's other devices are in
the other groups), so the node's network bandwidth, ``nics_per_node x
inter_node_bandwidth``, is shared evenly: each device's share is
``s = nics_per_node x inter_node_bandwidth / devices_per_node`` (one NIC per
GPU on a DGX: ``s`` is one NIC), and a group's ``g`` devices on a node
together cross the network at ``W = g x s``. NCCL runs one ring (channel)
per NIC, so a ring's traffic leaves each node over all of the group's NICs
at once; XLA's collectives on GPU are NCCL's. The candidates, for a result of
``B`` bytes per device (``lat``: the link's latency; ``intra``: the
intra-node bandwidth per direction):

======================  =====================================================================
algorithm               seconds
======================  =====================================================================
ring (every kind)       steps x lat_net + factor(n) x B / min(intra, W) (``timing``'s table)
tree (all-reduce)       2 (ceil(log2 m) lat_net + (g - 1) lat_intra) + 2 B / min(intra, W)
hierarchical (``g>1``)  inside each node over NVLink, then between nodes, each device over its
                        own share ``s`` (all-reduce: reduce-scatter, all-reduce of ``B / g``,
                        all-gather; all-gather: across nodes ``B / g``, then inside;
                        reduce-scatter: inside, then across nodes)
all-to-all              (n - 1) lat_net + max((g - 1) B / (n intra), (n - g) B / (n s))
collective-permute      lat_net + B / s
======================  =====================================================================

and a collective takes the fastest of its candidates (NCCL's tuner and
XLA's decomposition choose by the same kind of cost model). The ring's
factor is ``2(n-1)/n`` for an all-reduce, ``(n-1)/n`` for an all-gather and
an all-to-all, ``n-1`` for a reduce-scatter (its input is ``n x B``).
SHARP/NVLS in-network reductions are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .profiles import HardwareProfile

__all__ = ["Span", "algorithm_times", "network_seconds", "ring_factor"]


@dataclass(frozen=True)
class Span:
    """Where one group of a collective sits: ``size`` devices over ``nodes`` nodes, at most ``per_node`` of
    them on one node."""

    size: int
    nodes: int
    per_node: int

    @classmethod
    def inside_one_node(cls, size: int) -> Span:
        return cls(size, 1, size)


def ring_factor(kind: str, n: int) -> tuple[int, float]:
    """``(steps, factor)`` of a ring over ``n`` devices: its latency steps and the multiple of the result's
    bytes each device sends."""
    return {
        "all-reduce": (2 * (n - 1), 2 * (n - 1) / n),
        "all-gather": (n - 1, (n - 1) / n),
        "reduce-scatter": (n - 1, float(n - 1)),
        "all-to-all": (n - 1, (n - 1) / n),
        "collective-permute": (1, 1.0),
    }[kind]


def _ring(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    steps, factor = ring_factor(kind, n)
    return steps * latency + factor * nbytes / bandwidth


def algorithm_times(kind: str, nbytes: float, span: Span, profile: HardwareProfile) -> dict[str, float]:
    """Seconds of each algorithm that can run ``kind`` over a group placed as ``span`` (module docstring)."""
    n, m, g = span.size, span.nodes, span.per_node
    intra, lat_i = profile.intra_node_bandwidth, profile.intra_node_latency
    if n <= 1:
        return {"none": 0.0}
    if m <= 1:
        return {"ring": _ring(kind, nbytes, n, intra, lat_i)}
    share = profile.network_share
    crossing = min(intra, g * share)  # the group's NICs on one node, fed over NVLink
    lat_e = profile.inter_node_latency
    if kind == "collective-permute":
        return {"direct": lat_e + nbytes / share}
    if kind == "all-to-all":
        return {"direct": (n - 1) * lat_e + max((g - 1) * nbytes / (n * intra), (n - g) * nbytes / (n * share))}
    times = {"ring": _ring(kind, nbytes, n, crossing, lat_e)}
    if kind == "all-reduce":
        times["tree"] = 2 * (math.ceil(math.log2(m)) * lat_e + (g - 1) * lat_i) + 2 * nbytes / crossing
    if g > 1:
        if kind == "all-reduce":
            times["hierarchical"] = (2 * _ring("reduce-scatter", nbytes / g, g, intra, lat_i)
                                     + _ring("all-reduce", nbytes / g, m, share, lat_e))
        elif kind == "all-gather":
            times["hierarchical"] = (_ring("all-gather", nbytes / g, m, share, lat_e)
                                     + _ring("all-gather", nbytes, g, intra, lat_i))
        elif kind == "reduce-scatter":
            times["hierarchical"] = (_ring("reduce-scatter", m * nbytes, g, intra, lat_i)
                                     + _ring("reduce-scatter", nbytes, m, share, lat_e))
    return times


def network_seconds(kind: str, nbytes: float, span: Span, profile: HardwareProfile) -> float:
    """One execution of a collective of ``kind`` with a result of ``nbytes`` per device over a group placed
    as ``span``: the fastest of `algorithm_times`."""
    return min(algorithm_times(kind, nbytes, span, profile).values())
