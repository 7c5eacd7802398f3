"""A readable table of where every array of a pytree lives."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .fmt import format_bytes
from .layout import LeafLayout

__all__ = ["ShardingReport", "replicated_but_shardable"]

LARGE_BYTES = 1 << 20  # tensors from 1 MiB up are worth sharding


def _mesh(leaf: LeafLayout) -> str:
    return "x".join(f"{k}={v}" for k, v in leaf.sharding.mesh.shape.items())


def replicated_but_shardable(leaves: Iterable[LeafLayout], threshold: int = LARGE_BYTES) -> list[LeafLayout]:
    """Large arrays stored whole on every device although some mesh axis divides them."""
    out = []
    for leaf in leaves:
        if leaf.nbytes < threshold or leaf.bytes_per_device < leaf.nbytes:
            continue
        sizes = [s for s in leaf.sharding.mesh.shape.values() if s > 1]
        if any(dim % s == 0 for dim in leaf.shape for s in sizes):
            out.append(leaf)
    return out


@dataclass(frozen=True)
class ShardingReport:
    """Per array: path, shape, dtype, logical spec, PartitionSpec, mesh, bytes per device."""

    leaves: Sequence[LeafLayout]
    title: str = "sharding report"
    threshold: int = LARGE_BYTES
    notes: Sequence[str] = ()  # warnings found elsewhere (about the rules), listed with the table's own

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

    @property
    def warnings(self) -> list[str]:
        return list(self.notes) + [
            f"{leaf.path or '<root>'} ({format_bytes(leaf.nbytes)}, shape {leaf.shape}) is replicated on "
            f"every device of its mesh although a mesh axis divides it; give it a logical spec or a rule"
            for leaf in replicated_but_shardable(self.leaves, self.threshold)
        ]

    def rows(self) -> list[tuple[str, ...]]:
        return [
            (
                leaf.path or "<root>",
                str(leaf.shape),
                str(np.dtype(leaf.dtype)),
                "-" if leaf.logical is None else str(tuple(leaf.logical)),
                str(leaf.spec),
                _mesh(leaf),
                format_bytes(leaf.bytes_per_device),
            )
            for leaf in self.leaves
        ]

    def __str__(self) -> str:
        header = ("path", "shape", "dtype", "logical", "PartitionSpec", "mesh", "bytes/device")
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
        out += [f"warning: {w}" for w in self.warnings]
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"ShardingReport({len(self.leaves)} arrays, {format_bytes(self.total_bytes)})"
