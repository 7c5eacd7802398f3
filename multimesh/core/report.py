"""A readable table of where every array of a pytree lives."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from .fmt import device_span, format_bytes
from .layout import LeafLayout

__all__ = ["ShardingReport", "replicated_but_shardable", "stage_label"]

LARGE_BYTES = 1 << 20  # tensors from 1 MiB up are worth sharding


def _mesh(leaf: LeafLayout) -> str:
    return "x".join(f"{k}={v}" for k, v in leaf.mesh_shape.items()) or "one device"


def _device_ids(leaf: LeafLayout) -> frozenset[int]:
    # typed as the public jax.Device: the alias in jax's own hints is no type to mypy (jaxlib has no stubs)
    devices: set[jax.Device] = leaf.sharding.device_set
    return frozenset(d.id for d in devices)


def _stages_of(ids: frozenset[int], stages: Mapping[frozenset[int], str]) -> list[tuple[str, frozenset[int]]]:
    """The stages whose devices hold part of an array on devices ``ids``: one, or several for an array
    laid over them (a scanned stack split over stages lives on a mesh with a stage axis)."""
    return [(name, devs) for devs, name in stages.items() if devs <= ids]


def stage_label(leaf: LeafLayout, stages: Mapping[frozenset[int], str]) -> str:
    """Where ``leaf`` lives in an MPMD step: its stage's name and device ids (``"stage1 4-7"``;
    ``"stage0+stage1 0-7"`` for an array split over two stages); the ids alone when they hold no stage."""
    ids = _device_ids(leaf)
    span = device_span(sorted(ids))
    names = "+".join(name for name, _ in _stages_of(ids, stages))
    return f"{names} {span}" if names else span


def _bytes_held_by(leaf: LeafLayout, ids: frozenset[int]) -> int:
    """Bytes of the distinct pieces of ``leaf`` that the devices ``ids`` hold (each piece once)."""
    if not leaf.shape:
        return leaf.nbytes
    placed: Mapping[jax.Device, Any] = leaf.sharding.devices_indices_map(leaf.shape)  # as in _device_ids
    pieces = {tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape)) for d, index in placed.items() if d.id in ids}
    itemsize = np.dtype(leaf.dtype).itemsize
    return sum(int(np.prod([stop - start for start, stop in piece], dtype=np.int64)) * itemsize for piece in pieces)


def replicated_but_shardable(leaves: Iterable[LeafLayout], threshold: int = LARGE_BYTES) -> list[LeafLayout]:
    """Large arrays stored whole on every device although some mesh axis divides them."""
    out = []
    for leaf in leaves:
        if leaf.nbytes < threshold or leaf.bytes_per_device < leaf.nbytes:
            continue
        sizes = [s for s in leaf.mesh_shape.values() if s > 1]
        if any(dim % s == 0 for dim in leaf.shape for s in sizes):
            out.append(leaf)
    return out


@dataclass(frozen=True)
class ShardingReport:
    """Per array: path, shape, dtype, logical spec, PartitionSpec, mesh, bytes per device; with
    ``stages`` (an MPMD step), also the stage each array lives on, by name and device ids."""

    leaves: Sequence[LeafLayout]
    title: str = "sharding report"
    threshold: int = LARGE_BYTES
    notes: Sequence[str] = ()  # warnings found elsewhere (about the rules), listed with the table's own
    #: The stages of an MPMD step: device ids -> stage name. Empty (SPMD): no stage column, since every
    #: array is on the one mesh.
    stages: Mapping[frozenset[int], str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def bytes_per_device(self) -> dict:
        """Bytes each device holds (devices of every mesh in the tree)."""
        per: dict = {}
        for leaf in self.leaves:
            for d in leaf.sharding.device_set:
                per[d] = per.get(d, 0) + leaf.bytes_per_device
        return per

    def bytes_per_stage(self, prefix: str = "") -> dict[str, int]:
        """Bytes of the arrays whose path starts with ``prefix`` on each stage, in stage order (whole
        arrays, not per device; an array split over stages counts its part on each); ``{}`` without
        ``stages``. Arrays on devices that hold no stage count under their device ids."""
        if not self.stages:
            return {}
        per = dict.fromkeys(self.stages.values(), 0)
        for leaf in self.leaves:
            if not leaf.path.startswith(prefix):
                continue
            ids = _device_ids(leaf)
            held = _stages_of(ids, self.stages)
            if not held:
                key = device_span(sorted(ids))
                per[key] = per.get(key, 0) + leaf.nbytes
            for name, devs in held:
                per[name] += leaf.nbytes if len(held) == 1 else _bytes_held_by(leaf, devs)
        return per

    @property
    def warnings(self) -> list[str]:
        return list(self.notes) + [
            f"{leaf.path or '<root>'} ({format_bytes(leaf.nbytes)}, shape {leaf.shape}) is replicated on "
            f"every device of its mesh although a mesh axis divides it; give it a logical spec or a rule"
            for leaf in replicated_but_shardable(self.leaves, self.threshold)
        ]

    def header(self) -> tuple[str, ...]:
        stage = ("stage",) if self.stages else ()
        return ("path", "shape", "dtype", "logical", "PartitionSpec", "mesh", *stage, "bytes/device")

    def rows(self) -> list[tuple[str, ...]]:
        """One row per array, the columns of :meth:`header`."""
        return [
            (
                leaf.path or "<root>",
                str(leaf.shape),
                str(np.dtype(leaf.dtype)),
                "-" if leaf.logical is None else str(tuple(leaf.logical)),
                str(leaf.spec),
                _mesh(leaf),
                *((stage_label(leaf, self.stages),) if self.stages else ()),
                format_bytes(leaf.bytes_per_device),
            )
            for leaf in self.leaves
        ]

    def __str__(self) -> str:
        header = self.header()
        rows = self.rows()
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        per_device = self.bytes_per_device()
        most = max(per_device.values(), default=0)
        out = [self.title, line(header), line(tuple("-" * w for w in widths))]
        out += [line(r) for r in rows]
        out.append(
            f"total {format_bytes(self.total_bytes)} in {len(rows)} arrays; "
            f"at most {format_bytes(most)} on one of {len(per_device)} devices"
        )
        if self.stages:
            out.append("per stage: " + ", ".join(f"{name} {format_bytes(n)}"
                                                 for name, n in self.bytes_per_stage().items()))
        out += [f"warning: {w}" for w in self.warnings]
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"ShardingReport({len(self.leaves)} arrays, {format_bytes(self.total_bytes)})"
