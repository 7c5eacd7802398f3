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
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.metadata import array_metadata
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.serialization import jax_array_handlers as orbax_arrays
from orbax.checkpoint._src.serialization import types

__all__ = ["StageLocalSerialize"]


class StageLocalSerialize:
    """Mixin for ``ocp.type_handlers.ArrayHandler``: saves stage-local arrays of a multi-process run."""

    async def serialize(self, values: Sequence[Any], infos: Sequence[Any], args: Sequence[Any] | None = None) -> list:
        if jax.process_count() == 1 or all(isinstance(v, jax.Array) and not v.is_fully_addressable
                                           and v.addressable_shards for v in values):
            return await super().serialize(values, infos, args)  # type: ignore[misc]
        h: Any = self
        args = args or [types.SaveArgs()] * len(values)
        types.check_input_arguments(values, infos, args)
        orbax_arrays.check_array_values(values, infos, raise_error=not h.has_dispatcher())
        h._ext_metadata = {}
        arrays = []
        for v, info in zip(values, infos):
            if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
                arrays.append(jax.random.key_data(v))
                h._ext_metadata[info.name] = {array_metadata.RANDOM_KEY_IMPL: str(jax.random.key_impl(v))}
            else:
                arrays.append(v)
        futures: list = []
        if h._enable_write_sharding_file:
            shardings = orbax_arrays._async_serialize_shardings(
                shardings=[a.sharding for a in arrays], infos=infos, primary_host=h._primary_host)
            futures.append(future.CommitFutureAwaitingContractedSignals(
                asyncio_utils.cancellable(shardings, message="sharding metadata commit cancelled",
                                          process_index=multihost.process_index(), reraise=False),
                name="serialize_shardings"))
        # Each array's first process creates its metadata (Orbax's primary host would, for arrays it may
        # not hold); the processes holding its shards write them.
        writers: dict[int, list[int]] = {}
        for i, a in enumerate(arrays):
            if a.addressable_shards:
                writers.setdefault(min(d.process_index for d in a.sharding.device_set), []).append(i)
        for writer, idx in sorted(writers.items()):
            futures.append(orbax_arrays._serialize_arrays(
                arrays=[arrays[i] for i in idx], infos=[infos[i] for i in idx], args=[args[i] for i in idx],
                dispatcher=h._dispatcher, primary_host=None if h._primary_host is None else writer,
                replica_id=h._replica_id, use_replica_parallel=h._use_replica_parallel,
                min_slice_bytes_for_replica_parallel=h._min_slice_bytes_for_replica_parallel,
                max_replicas_for_replica_parallel=h._max_replicas_for_replica_parallel,
                enable_replica_parallel_separate_folder=h._enable_replica_parallel_separate_folder,
                metadata_key=h._metadata_key, ext_metadata=h._ext_metadata,
                array_metadata_store=h._array_metadata_store, callback=h._callback))
        return futures

