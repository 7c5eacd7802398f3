"""A split layer stack's data, and how its arrays are laid out: one array over the stages' union mesh.

`scan_split` cuts a scanned stack into layer ranges, one per stage (a
`StackSplit`), and holds some of the step's values in parts along a
dimension (a `SplitArray`); a `Boundary` says which of the step's inputs
and outputs travel as parts. Outside the step, such an array is one
`jax.Array` on the *union* of the parts' submeshes (stacked along a leading
``stage`` axis), its split dimension sharded over ``stage`` and, inside a
stage, as its own layout says (`union_sharding`): the shards of layers
``[first, stop)`` live on that range's stage only. `part_sharding` is a
part's sharding on its stage; `widen_layout` puts a step's split inputs on
their union shardings.

The parts must be alike for one union sharding to hold them (`check_stackable`):
ranges of equal length, on distinct submeshes of one shape and axis names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.layout import Layout, LeafLayout
from ..trace.task import Placement

__all__ = ["STAGE_AXIS", "Boundary", "SplitArray", "StackSplit", "check_stackable", "part_sharding", "union_mesh",
           "union_sharding", "widen_layout"]

#: The union mesh's leading axis: one entry per part (stage) of a split stack.
STAGE_AXIS = "stage"


@dataclass(frozen=True)
class StackSplit:
    """One split registration applied to one scanned stack: its layer ranges and their placements."""

    label: str
    ranges: tuple[tuple[int, int], ...]
    placements: tuple[Placement, ...]

    @property
    def length(self) -> int:
        return self.ranges[-1][1]

    @property
    def markers(self) -> list[str]:
        """The scope name of each part's scan: ``layers[0:2]``."""
        return [f"{self.label}[{a}:{b}]" for a, b in self.ranges]

    def describe(self) -> str:
        return ", ".join(f"{m} on {p.name}" for m, p in zip(self.markers, self.placements))


@dataclass(frozen=True)
class SplitArray:
    """A step input or output held as the parts of ``split`` along dimension ``axis``."""

    split: StackSplit
    axis: int

    def part_shape(self, shape: Sequence[int], k: int) -> tuple[int, ...]:
        a, b = self.split.ranges[k]
        out = list(shape)
        out[self.axis] = b - a
        return tuple(out)


@dataclass(frozen=True)
class Boundary:
    """Which step inputs and outputs the rewritten step takes or returns as parts (None: whole)."""

    inputs: tuple[SplitArray | None, ...]
    outputs: tuple[SplitArray | None, ...]

    def plan_index(self, i: int) -> int:
        """The position of step input ``i``'s first part (or itself) among the rewritten step's inputs."""
        return sum(1 if s is None else len(s.split.ranges) for s in self.inputs[:i])


def check_stackable(split: StackSplit) -> None:
    """The parts of a split stack held as one array: equal ranges on distinct submeshes of one shape."""
    sizes = [b - a for a, b in split.ranges]
    what = f"splitting the scan {split.label!r} into {split.describe()}"
    if len(set(sizes)) > 1:
        raise NotImplementedError(
            f"{what}: the layer ranges have unequal lengths {sizes}; a stacked parameter stays one jax.Array "
            f"whose layer axis is sharded over the stages, and JAX gives every shard of an array the same shape, "
            f"so the ranges must be equal: give every range the same number of layers (or, for unequal stages, "
            f"stack fewer layers per scan and place the modules with callback=)")
    meshes = [p.mesh for p in split.placements]
    if len({frozenset(m.devices.flat) for m in meshes}) < len(meshes) or any(
            set(m.devices.flat) & set(n.devices.flat) for i, m in enumerate(meshes) for n in meshes[i + 1:]):
        raise NotImplementedError(f"{what}: two ranges share devices; each range needs its own submesh "
                                  f"(a range per stage; interleaved stages of one stack are not supported yet)")
    shapes = {(tuple(m.axis_names), tuple(m.devices.shape)) for m in meshes}
    if len(shapes) > 1:
        raise NotImplementedError(f"{what}: the stages' submeshes differ in shape or axis names {sorted(shapes)}; "
                                  f"a split stack needs every stage shaped alike")


_UNION: dict[StackSplit, Mesh] = {}


def union_mesh(split: StackSplit) -> Mesh:
    """The parts' submeshes stacked along a leading ``stage`` axis (part k at index k)."""
    if split not in _UNION:
        check_stackable(split)
        first = split.placements[0].mesh
        if STAGE_AXIS in first.axis_names:
            raise NotImplementedError(f"the stages of the split scan {split.label!r} have a mesh axis named "
                                      f"{STAGE_AXIS!r}, which the union mesh of a split stack uses; rename it")
        devices = np.stack([np.asarray(p.mesh.devices) for p in split.placements])
        types = getattr(first, "axis_types", None)
        kwargs = {"axis_types": (types[0],) + tuple(types)} if types else {}
        _UNION[split] = Mesh(devices, (STAGE_AXIS, *first.axis_names), **kwargs)
    return _UNION[split]


def _entry_axes(entry: Any) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def union_sharding(how: SplitArray, within: PartitionSpec, ndim: int) -> NamedSharding:
    """The whole array's sharding: ``within`` (a stage's spec) with the split axis also over ``stage``."""
    entries = list(within) + [None] * (ndim - len(within))
    entries[how.axis] = (STAGE_AXIS, *_entry_axes(entries[how.axis]))
    return NamedSharding(union_mesh(how.split), PartitionSpec(*entries))


def part_sharding(how: SplitArray, union: NamedSharding, k: int) -> NamedSharding:
    """Part ``k``'s sharding on its stage's submesh, from the whole array's `union_sharding`."""
    entries = list(union.spec)
    rest = tuple(a for a in _entry_axes(entries[how.axis]) if a != STAGE_AXIS)
    entries[how.axis] = None if not rest else rest[0] if len(rest) == 1 else rest
    return NamedSharding(how.split.placements[k].mesh, PartitionSpec(*entries))


def widen_layout(layout: Layout, splits: Sequence[SplitArray | None]) -> Layout:
    """``layout`` with each split leaf on its `union_sharding` (its other dimensions sharded as derived)."""
    if not any(splits):
        return layout
    flat, tree = jax.tree.flatten(layout.shardings)
    leaves = list(layout.leaves)
    for i, how in enumerate(splits):
        if how is None:
            continue
        leaf = leaves[i]
        sharding = union_sharding(how, flat[i].spec, len(leaf.shape))
        _check_divides(leaf, how, sharding)
        flat[i] = sharding
        leaves[i] = LeafLayout(leaf.path, leaf.shape, leaf.dtype, leaf.logical, f"{leaf.source}, split stack", sharding)
    return Layout(jax.tree.unflatten(tree, flat), tuple(leaves))


def _check_divides(leaf: LeafLayout, how: SplitArray, sharding: NamedSharding) -> None:
    axes = _entry_axes(sharding.spec[how.axis])
    size = math.prod(sharding.mesh.shape[a] for a in axes)
    if leaf.shape[how.axis] % size:
        raise ValueError(f"{leaf.path!r} {leaf.shape}: dimension {how.axis}, the layer axis of the split scan "
                         f"{how.split.label!r}, is sharded over {axes} (size {size}), which does not divide "
                         f"{leaf.shape[how.axis]}; shard it over fewer devices inside a stage")
