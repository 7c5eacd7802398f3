"""What a layout must hold per device, known before building the step on it.

The arrays a step holds (parameters, optimizer state, batch) and the names
of their dimensions are the same on every layout (`checks.LeafNames`); a
layout's rules map those names to its mesh axes. So once the step is built on
one layout, every other layout's share of those arrays per device is known
without tracing the step again: each array's bytes over the product of the
mesh axes its rules name, a lower bound (a dimension the axes do not divide
stays whole, never splits further). A pipeline's stages share the arrays, so
its busiest device holds at least the bound over the stages.

A search sets a layout aside unbuilt where this bound alone exceeds the
memory limit: building it would find at least as many bytes held and reject
it the same (`search._estimated`), after a trace that costs seconds on a large
model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from ..core.meshes import spec_names
from ..core.rules import Rules, resolve
from .layouts import ParallelLayout

__all__ = ["HeldArrays"]


@dataclasses.dataclass(frozen=True)
class HeldArrays:
    """The arrays a built step holds, each as (bytes, the names of its dimensions: a tuple of logical names, or a
    `PartitionSpec` of mesh axes its code or ``param_rules`` gave it)."""

    arrays: tuple[tuple[int, tuple | PartitionSpec | None], ...]

    @classmethod
    def of(cls, step_fn: Any) -> HeldArrays:
        leaves = (*step_fn.param_layout.leaves, *step_fn.batch_layout.leaves)
        return cls(tuple((int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize, leaf.logical)
                         for leaf in leaves))

    def least_per_device(self, layout: ParallelLayout, rules: Rules) -> int:
        """Bytes the busiest device of ``layout`` holds at least, its arrays laid out by ``rules``."""
        sizes = layout.mesh
        total = 0
        for nbytes, logical in self.arrays:
            if isinstance(logical, PartitionSpec):
                axes = spec_names(logical)
            else:
                try:
                    axes = spec_names(resolve(logical, rules, sizes))  # no shape: as if every size divided
                except ValueError:  # the build says why; bound it by the whole mesh
                    axes = set(sizes)
            total += nbytes // math.prod(sizes.get(a, 1) for a in axes)
        return total // layout.stages
