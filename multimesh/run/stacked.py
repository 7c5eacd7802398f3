"""A split layer stack's arrays at the step's boundary: the whole array <-> its per-stage parts, zero-copy.

A stacked parameter of a scan split over stages (`plan.scan_split`) is one
`jax.Array` on the *union* of the stages' submeshes (`plan.stack_layout`), its
layer axis sharded over the union's ``stage`` axis: the shards of layers ``[first, stop)`` sit
on that range's stage only. The plan's programs run on one stage each, so
each takes its part as an array of that stage (`to_parts`), and the step's
outputs are put back together from the parts (`from_parts`). Both reuse the
device buffers (`jax.make_array_from_single_device_arrays`): nothing is
copied, except an input that arrives in another layout (a restored state,
say), which is first moved onto the union sharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..core.transfer import move
from ..plan.stack_layout import STAGE_AXIS, SplitArray, part_sharding, union_mesh, union_sharding

__all__ = ["from_parts", "part_shardings", "to_parts", "union_for"]


def part_shardings(splits: Sequence[SplitArray | None], shardings: Sequence[NamedSharding]) -> list[NamedSharding]:
    """Step input shardings as the plan's inputs: a split input's union sharding becomes its parts'."""
    out = []
    for how, s in zip(splits, shardings):
        out.extend([s] if how is None else [part_sharding(how, s, k) for k in range(len(how.split.ranges))])
    return out


def _view(x: jax.Array, shape: tuple[int, ...], sharding: NamedSharding) -> jax.Array:
    """The shards ``x`` holds on ``sharding``'s devices, as one array of ``shape`` there (no copy)."""
    by_device = {s.device: s.data for s in x.addressable_shards}
    arrays = [by_device[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=x.dtype)


def to_parts(flat: Sequence[Any], splits: Sequence[SplitArray | None],
             shardings: Sequence[NamedSharding | None]) -> list:
    """The step's flat inputs as the plan's: each split input as its parts, each on its stage (``shardings``:
    each split input's union sharding, None for the others)."""
    out: list = []
    for x, how, union in zip(flat, splits, shardings):
        if how is None:
            out.append(x)
            continue
        if union is None:
            raise AssertionError(f"the input split as {how.split.label!r} has no union sharding")
        if not (isinstance(x, jax.Array) and x.sharding == union):
            (x,) = move([x], [union])
        out.extend(_view(x, how.part_shape(x.shape, k), part_sharding(how, union, k))
                   for k in range(len(how.split.ranges)))
    return out


def from_parts(flat: Sequence[Any], splits: Sequence[SplitArray | None],
               targets: Sequence[NamedSharding | None]) -> list:
    """The plan's flat outputs as the step's: each split output's parts as one array on the union sharding
    (its target's when that is a union sharding of the same split, else one derived from the first part)."""
    out: list = []
    it = iter(flat)
    for how, target in zip(splits, targets):
        if how is None:
            out.append(next(it))
            continue
        parts = [next(it) for _ in how.split.ranges]
        shape = list(parts[0].shape)
        shape[how.axis] = sum(p.shape[how.axis] for p in parts)
        union = target if _is_union_of(target, how) else _default_union(parts[0], how)
        arrays: list[jax.Array] = []
        for k, p in enumerate(parts):
            want = part_sharding(how, union, k)
            if p.sharding != want:
                (p,) = move([p], [want])
            arrays.extend(s.data for s in p.addressable_shards)
        # dtype: a process may hold no shard of it (its stages run elsewhere)
        out.append(jax.make_array_from_single_device_arrays(tuple(shape), union, arrays, dtype=parts[0].dtype))
    return out


def _is_union_of(target: Any, how: SplitArray) -> TypeGuard[NamedSharding]:
    """Whether ``target`` is a sharding of ``how``'s union mesh with the split axis over its stages."""
    if not isinstance(target, NamedSharding) or target.mesh != union_mesh(how.split) or len(target.spec) <= how.axis:
        return False
    entry = target.spec[how.axis]
    return STAGE_AXIS in ((entry,) if isinstance(entry, str) else tuple(entry or ()))


def _default_union(part: jax.Array, how: SplitArray) -> NamedSharding:
    s = part.sharding
    within = s.spec if isinstance(s, NamedSharding) and s.mesh == how.split.placements[0].mesh else PartitionSpec()
    return union_sharding(how, within, part.ndim)


def union_for(x: Any, how: SplitArray) -> NamedSharding:
    """Where a whole split array ``x`` goes over its stages: its own sharding when that already is a union
    sharding of ``how``; else the union sharding with ``x``'s spec inside each stage when ``x`` lies on a
    mesh with the stages' axis names (a whole stage, say), else replicated inside each stage."""
    s = getattr(x, "sharding", None)
    if _is_union_of(s, how):
        return s
    stage = how.split.placements[0].mesh
    if isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == tuple(stage.axis_names) and all(
            s.mesh.shape[a] == stage.shape[a] for a in stage.axis_names):
        return union_sharding(how, s.spec, len(x.shape))
    return union_sharding(how, PartitionSpec(), len(x.shape))
