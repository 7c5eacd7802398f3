"""What the step's inputs hold on each device, exactly: parameters, optimizer state and batch, per device id.

Read from the step's layouts (each leaf's shape, dtype and sharding), so
nothing is allocated. A shard's bytes are those of the slice the sharding
gives the device (`devices_indices_map`), so uneven and replicated shards
count exactly what an array built with that sharding holds there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Sharding

from ..core.layout import LeafLayout

__all__ = ["DEFAULT_OPTIMIZER_PATHS", "HeldBytes", "held_bytes", "is_optimizer_path", "shard_bytes", "slice_bytes"]

#: A leaf under a path component named ``opt_state`` or ``opt`` is optimizer state (a TrainState,
#: ``{"params": ..., "opt_state": ...}``); the rest are parameters.
DEFAULT_OPTIMIZER_PATHS = r"(^|/)(opt_state|opt)(/|$)"


@dataclass(frozen=True)
class HeldBytes:
    """Bytes per device id, by kind: ``params``, ``optimizer`` (0 when no leaf is optimizer state) and ``batch``."""

    params: dict[int, int]
    optimizer: dict[int, int]
    batch: dict[int, int]

    def total(self, device: int) -> int:
        return self.params.get(device, 0) + self.optimizer.get(device, 0) + self.batch.get(device, 0)


def slice_bytes(shape: tuple[int, ...], itemsize: int, sharding: Sharding) -> dict[int, int]:
    """Device id -> bytes of the slice of an array of ``shape`` that ``sharding`` gives the device."""
    out = {}
    device: jax.Device
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        n = 1
        for size, sl in zip(shape, index):
            n *= len(range(*sl.indices(size)))
        out[device.id] = n * itemsize
    return out


def shard_bytes(leaf: LeafLayout) -> dict[int, int]:
    """Device id -> bytes of ``leaf``'s shard there."""
    return slice_bytes(tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, leaf.sharding)


def is_optimizer_path(path: str, pattern: str = DEFAULT_OPTIMIZER_PATHS) -> bool:
    try:
        return re.search(pattern, path) is not None
    except re.error as e:
        raise ValueError(f"optimizer_paths={pattern!r} is not a regular expression ({e}); give one matching the "
                         f"optimizer state's parameter paths, e.g. {DEFAULT_OPTIMIZER_PATHS!r}") from None


def _add(into: dict[int, int], leaves: Iterable[LeafLayout]) -> dict[int, int]:
    for leaf in leaves:
        for d, n in shard_bytes(leaf).items():
            into[d] = into.get(d, 0) + n
    return into


def held_bytes(params: Iterable[LeafLayout], batch: Iterable[LeafLayout],
               optimizer_paths: str = DEFAULT_OPTIMIZER_PATHS) -> HeldBytes:
    """Per device id, the bytes of the parameter, optimizer-state and batch shards."""
    params = list(params)
    opt = [leaf for leaf in params if is_optimizer_path(leaf.path, optimizer_paths)]
    rest = [leaf for leaf in params if not is_optimizer_path(leaf.path, optimizer_paths)]
    return HeldBytes(params=_add({}, rest), optimizer=_add({}, opt), batch=_add({}, batch))
