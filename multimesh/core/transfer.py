"""Moving a value onto another submesh."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["move", "reshard_to", "target_on"]


def target_on(x: Any, mesh: Mesh) -> NamedSharding:
    """``x``'s sharding on ``mesh``: its `PartitionSpec` where the mesh can hold it, else replicated."""
    sharding = getattr(x, "sharding", None)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    return NamedSharding(mesh, spec if _fits(spec, mesh, np.shape(x)) else PartitionSpec())


def move(xs: Sequence[Any], targets: Sequence[NamedSharding]) -> list[jax.Array]:
    """Every ``xs[i]`` onto ``targets[i]``, in one `jax.device_put` (the runtime's only transfer)."""
    return jax.device_put(list(xs), list(targets))


def reshard_to(x: Any, mesh: Mesh) -> jax.Array:
    """Move ``x`` onto ``mesh``, keeping its `PartitionSpec` where the mesh can hold it, else replicated."""
    return jax.device_put(x, target_on(x, mesh))


def _fits(spec: PartitionSpec, mesh: Mesh, shape: Sequence[int]) -> bool:
    sizes = dict(mesh.shape)
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        if any(a not in sizes for a in axes) or shape[d] % math.prod(sizes[a] for a in axes):
            return False
    return True
