"""`ParallelLayout`: one way to lay a step out on devices, and the candidates a search tries.

A layout is a per-stage mesh ``{axis: size}`` over the axes `standard_rules`
gives roles to (``data``: the batch; ``fsdp``: the batch and the parameters'
``embed`` dimension, gathered when used; ``tensor``: the Megatron dimensions
``mlp``, ``heads``, ``kv_heads``, ``vocab``; ``expert``: a Mixture of
Experts' experts, and the batch), the rule set (`named_rules`:
``"standard"``, or ``"sequence"``, which also splits activations' sequence
over the tensor axis), and for a pipeline its number of stages, microbatches
and schedule. The axes' sizes decide how much of each kind of parallelism a
layout has, so the meshes tried are every factorization of the devices per
stage over the axes; the sequence rules are tried on those with a tensor axis
(without one they are the standard rules).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..core.rules import RULE_SETS, Rules, named_rules

__all__ = ["AXES", "RULE_SETS", "STAGE_AXIS", "ParallelLayout", "enumerate_layouts", "factorizations"]

#: The mesh axes a search may factorize the devices over (``model`` is `standard_rules`' other name for tensor;
#: ``expert`` splits a Mixture of Experts' experts, and the batch as data does).
AXES = ("data", "fsdp", "expert", "tensor", "model")
#: The axes the ``sequence`` rules split activations' length over (with the Megatron dimensions).
_TENSOR_AXES = ("tensor", "model")
#: The axis of the whole mesh along which a pipeline's stages lie (outermost: stage s is a contiguous block).
#: Not ``stage``: a scanned stack split over the stages spans them on a union mesh with that axis.
STAGE_AXIS = "pipe"
#: Schedules whose stages each run several non-adjacent groups of layers (2 groups, the library's default).
_CHUNKS = {"interleaved": 2}


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered ``k``-tuple of positive ints whose product is ``n``."""
    if k == 1:
        return [(n,)]
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out += [(d, *rest) for rest in factorizations(n // d, k - 1)]
    return out


@dataclass(frozen=True)
class ParallelLayout:
    """A layout: ``mesh`` (each stage's ``{axis: size}``), ``rules`` (a name in `RULE_SETS`), ``stages``
    (1: SPMD), and for a pipeline ``microbatches``, ``schedule`` and ``chunks`` (layer groups per stage)."""

    mesh: dict[str, int] = field(hash=False)
    rules: str = "standard"
    stages: int = 1
    microbatches: int | None = None
    schedule: str | None = None
    chunks: int = 1

    def __hash__(self) -> int:
        return hash((tuple(self.mesh.items()), self.rules, self.stages, self.microbatches, self.schedule))

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values()) * self.stages

    @property
    def is_pipeline(self) -> bool:
        return self.stages > 1

    @property
    def whole_mesh(self) -> dict[str, int]:
        """The mesh `parallelize` is given: the stage mesh, after a ``pipe`` axis (`STAGE_AXIS`) for a pipeline."""
        return {STAGE_AXIS: self.stages, **self.mesh} if self.is_pipeline else dict(self.mesh)

    def rule_set(self) -> Rules:
        """The rules of ``rules`` for the whole mesh's axes."""
        return named_rules(self.rules, tuple(self.whole_mesh))

    def describe(self) -> str:
        """One line: ``data=2 x tensor=4``, or ``2 stages of data=2 x tensor=2, 1f1b, 8 microbatches`` (axes of
        size 1, which the model's own axes may be, left out)."""
        split = {a: n for a, n in self.mesh.items() if n > 1} or dict(list(self.mesh.items())[:1])
        mesh = " x ".join(f"{a}={n}" for a, n in split.items())
        if self.rules != "standard":
            mesh += f" ({self.rules} rules)"
        if not self.is_pipeline:
            return mesh
        groups = f" ({self.chunks} groups/stage)" if self.chunks > 1 else ""
        return f"{self.stages} stages of {mesh}, {self.schedule}{groups}, {self.microbatches} microbatches"

    def __repr__(self) -> str:
        return f"ParallelLayout({self.describe()})"


def _mesh(axes: Sequence[str], sizes: Sequence[int], required: Sequence[str]) -> dict[str, int]:
    """The axes of size > 1 in order, then the ``required`` ones left (size 1); one device and nothing
    required: the first axis, size 1."""
    mesh = {a: n for a, n in zip(axes, sizes) if n > 1}
    mesh.update((a, 1) for a in required if a not in mesh)
    return mesh or {axes[0]: 1}


def enumerate_layouts(num_devices: int, axes: Sequence[str], stage_counts: Sequence[int],
                      microbatches: Sequence[int], schedules: Sequence[str],
                      rule_sets: Sequence[str] = ("standard",), required: Sequence[str] = ()
                      ) -> Iterator[ParallelLayout]:
    """Every layout of ``num_devices``: per stage count dividing them, every mesh of the devices per stage
    over ``axes`` with each of ``rule_sets`` (``sequence`` only on a mesh with a tensor axis), and for a
    pipeline every microbatch count and schedule (duplicates left out). Every mesh has the ``required`` axes
    (the model's own, `model_axes`), of size 1 where it does not split them."""
    unknown = [r for r in rule_sets if r not in RULE_SETS]
    if unknown or not rule_sets:
        raise ValueError(f"rule_sets={tuple(rule_sets)!r}: give names among {RULE_SETS}")
    seen: set[ParallelLayout] = set()
    for stages in stage_counts:
        if num_devices % stages:
            continue
        meshes = [_mesh(axes, sizes, required) for sizes in factorizations(num_devices // stages, len(axes))]
        runs = itertools.product(microbatches, schedules) if stages > 1 else [(None, None)]
        for (m, schedule), mesh, rules in itertools.product(list(runs), meshes, rule_sets):
            if rules == "sequence" and not any(mesh.get(a, 1) > 1 for a in _TENSOR_AXES):
                continue
            layout = ParallelLayout(mesh, rules, stages, m, schedule, _CHUNKS.get(schedule, 1) if schedule else 1)
            if layout not in seen:
                seen.add(layout)
                yield layout
