"""Moving a value onto another submesh."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["reshard_to"]


def reshard_to(x: Any, mesh: Mesh, spec: PartitionSpec | None = None) -> jax.Array:
    """Move ``x`` onto ``mesh``, keeping its `PartitionSpec` where the mesh can hold it, else replicated."""
    if spec is None:
        sharding = getattr(x, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        if not _fits(spec, mesh, np.shape(x)):
            spec = PartitionSpec()
    return jax.device_put(x, NamedSharding(mesh, spec))


def _fits(spec: PartitionSpec, mesh: Mesh, shape: Sequence[int]) -> bool:
    sizes = dict(mesh.shape)
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        if any(a not in sizes for a in axes) or shape[d] % math.prod(sizes[a] for a in axes):
            return False
    return True
