"""Saving arrays that live on one process's devices, in a multi-process run.

A pipeline stage on one host holds arrays whose devices all belong to one
process. They are global arrays (every other process holds a placeholder with
no shards, and their shards are written once, by the process that has them),
but Orbax 0.12's ``ArrayHandler.serialize`` refuses any fully addressable
array when several processes run, taking it for a per-host ``pmap`` array,
and fails on an array with no shard in this process.

`StageLocalSerialize` is a mixin for an ``ArrayHandler`` that, only when
such arrays are present, saves as Orbax does, through the same helpers
(orbax-checkpoint is pinned to 0.12), but without that check, and with each
array's metadata created by the first process holding it instead of process
0, which may hold none of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from .._compat.orbax import serialize_arrays_written_by

__all__ = ["StageLocalSerialize"]


class StageLocalSerialize:
    """Mixin for ``ocp.type_handlers.ArrayHandler``: saves stage-local arrays of a multi-process run."""

    async def serialize(self, values: Sequence[Any], infos: Sequence[Any], args: Sequence[Any] | None = None) -> list:
        if jax.process_count() == 1 or all(isinstance(v, jax.Array) and not v.is_fully_addressable
                                           and v.addressable_shards for v in values):
            return await super().serialize(values, infos, args)  # type: ignore[misc]
        return serialize_arrays_written_by(self, values, infos, args, _first_process_holding)  # type: ignore[arg-type]


def _first_process_holding(a: jax.Array) -> int | None:
    """The process that creates ``a``'s metadata: the first holding a shard of it (Orbax's primary host
    would, for arrays it may not hold); None where this process holds none (the processes holding its
    shards write them)."""
    devices: set[jax.Device] = a.sharding.device_set
    return min(d.process_index for d in devices) if a.addressable_shards else None
