"""Orbax internals used by multimesh's checkpoints (tested: the suite on orbax-checkpoint 0.12.8, its smoke
subset on 0.12.3).

multimesh saves and restores through Orbax's handlers; it reaches below their public API to save the
arrays of pipeline stages held by one process of several, to read leaner than Orbax does, to write
without Orbax's per-reservation debug formatting, to complete a JSON document in the background
commit, to see that a part of a save failed while others still write, and to release Orbax's
signal-waiting threads after a failed save. Each function names the
public API that would replace it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.metadata import array_metadata
from orbax.checkpoint._src.metadata import array_metadata_store as array_metadata_store_lib
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.serialization import jax_array_handlers as orbax_arrays
from orbax.checkpoint._src.serialization import limits, tensorstore_utils, types

__all__ = [
    "JsonHandlerPreparingWrites",
    "LeanByteLimit",
    "array_metadata_store",
    "array_read_spec",
    "cancel_signaling_thread",
    "handler_metadata_key",
    "is_orbax_byte_limiter",
    "save_part_threads",
    "serialize_arrays_written_by",
    "signaling_thread_class",
    "signaling_thread_error",
    "use_pytree_handler",
]


def array_metadata_store() -> Any:
    """A new store of Orbax's per-process array metadata (``array_metadata_store.Store``), to pass as
    ``ArrayHandler(array_metadata_store=...)``.

    Public replacement: none (``ArrayHandler`` takes the store but Orbax does not export its class).
    Tested on orbax-checkpoint 0.12.8.
    """
    return array_metadata_store_lib.Store()


def handler_metadata_key(handler: ocp.type_handlers.ArrayHandler) -> str | None:
    """The ``metadata_key`` an ``ArrayHandler`` was made with.

    Public replacement: none (keep the argument passed to ``ArrayHandler``). Tested on orbax-checkpoint 0.12.8.
    """
    return handler._metadata_key


def array_read_spec(info: Any, metadata_key: str | None) -> dict:
    """The TensorStore spec (JSON) Orbax opens to read the array of ``info`` (a ``ParamInfo``) from an
    OCDBT checkpoint.

    Public replacement: none (``ArrayHandler.deserialize`` builds it inside). Tested on orbax-checkpoint 0.12.8.
    """
    return tensorstore_utils.build_array_read_spec(
        info, use_ocdbt=True, metadata_key=metadata_key,
        raise_array_data_missing_error=info.raise_array_data_missing_error).json


def is_orbax_byte_limiter(limiter: Any) -> bool:
    """Whether ``limiter`` (a ``ParamInfo.byte_limiter``) is exactly Orbax's ``LimitInFlightBytes``.

    Public replacement: none. Tested on orbax-checkpoint 0.12.8.
    """
    return type(limiter) is limits.LimitInFlightBytes


class LeanByteLimit(limits.LimitInFlightBytes):
    """Orbax's ``LimitInFlightBytes`` (same limit, same waiting) without its debug-log lines, whose sizes
    are formatted (``humanize``) on every reservation even when the log is off (4 strings per shard
    written).

    Public replacement: Orbax's own limiter, once it formats only when logging. Tested on
    orbax-checkpoint 0.12.8.
    """

    async def wait_for_bytes(self, requested_bytes: int):
        if requested_bytes >= self._max_bytes:
            raise ValueError(f"Requested more bytes than we reserved space for: "
                             f"{requested_bytes} > {self._max_bytes}")
        async with self._cv:
            await self._cv.wait_for(lambda: self._available_bytes > requested_bytes)
            self._available_bytes -= requested_bytes

    async def release_bytes(self, requested_bytes: int):
        async with self._cv:
            self._available_bytes += requested_bytes
            self._cv.notify_all()


def serialize_arrays_written_by(handler: ocp.type_handlers.ArrayHandler, values: Sequence[Any],
                                infos: Sequence[Any], args: Sequence[Any] | None,
                                writer: Callable[[jax.Array], int | None]) -> list:
    """What ``ArrayHandler.serialize`` returns (the commit futures), made as Orbax makes them, but without
    its refusal of fully addressable arrays in a multi-process run, and with each array's metadata
    created by process ``writer(array)`` instead of the handler's primary host (None: the array has no
    shard in this process; it is written by the processes that hold it).

    Public replacement: ``ArrayHandler.serialize``, once it accepts arrays whose devices all belong to
    one process of several. Tested on orbax-checkpoint 0.12.8.
    """
    h: Any = handler
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
    writers: dict[int, list[int]] = {}
    for i, a in enumerate(arrays):
        w = writer(a)
        if w is not None:
            writers.setdefault(w, []).append(i)
    for w, idx in sorted(writers.items()):
        futures.append(orbax_arrays._serialize_arrays(
            arrays=[arrays[i] for i in idx], infos=[infos[i] for i in idx], args=[args[i] for i in idx],
            dispatcher=h._dispatcher, primary_host=None if h._primary_host is None else w,
            replica_id=h._replica_id, use_replica_parallel=h._use_replica_parallel,
            min_slice_bytes_for_replica_parallel=h._min_slice_bytes_for_replica_parallel,
            max_replicas_for_replica_parallel=h._max_replicas_for_replica_parallel,
            enable_replica_parallel_separate_folder=h._enable_replica_parallel_separate_folder,
            metadata_key=h._metadata_key, ext_metadata=h._ext_metadata,
            array_metadata_store=h._array_metadata_store, callback=h._callback))
    return futures


def use_pytree_handler(handler: ocp.StandardCheckpointHandler, pytree: ocp.PyTreeCheckpointHandler) -> None:
    """Makes ``handler`` save and restore through ``pytree`` (for its compression and type handlers).

    Public replacement: none (``StandardCheckpointHandler`` takes neither). Tested on orbax-checkpoint 0.12.8.
    """
    handler._impl = pytree  # type: ignore[attr-defined]


class JsonHandlerPreparingWrites(ocp.JsonCheckpointHandler):
    """Orbax's ``JsonCheckpointHandler`` that passes each document through `prepare` (in the background
    commit) just before writing it.

    Public replacement: none (the document is written as saved). Tested on orbax-checkpoint 0.12.8.
    """

    async def prepare(self, x: Any) -> Any:
        """The document to write for ``x`` (``x`` itself here)."""
        return x

    async def _save_fn(self, x, directory):
        await super()._save_fn(await self.prepare(x), directory)


def signaling_thread_class() -> type | None:
    """The class of Orbax's threads that wait for commit signals (None if this Orbax has none).

    Public replacement: none. Tested on orbax-checkpoint 0.12.8.
    """
    return getattr(future, "_SignalingThread", None)


def save_part_threads(manager: ocp.CheckpointManager) -> list[threading.Thread]:
    """The threads running the parts of ``manager``'s last asynchronous save (its commit futures: the step
    directory's creation, each item's writes), ended ones included; empty for a synchronous manager.

    Public replacement: none (Orbax waits for the parts in order and reports a part's error only once every
    part before it has ended). Tested on orbax-checkpoint 0.12.8.
    """
    checkpointer: Any = manager._checkpointer  # type: ignore[attr-defined]
    pending = list(getattr(getattr(checkpointer, "_async_manager", None), "_commit_futures", None) or ())
    threads = []
    while pending:
        f = pending.pop()
        inner = getattr(f, "_f", f)  # CommitFutureAwaitingContractedSignals wraps a CommitFuture
        if isinstance(getattr(inner, "_t", None), threading.Thread):
            threads.append(inner._t)
        pending.extend(getattr(f, "_futures", ()))  # a ChainedFuture's
    return threads


def signaling_thread_error(thread: threading.Thread) -> BaseException | None:
    """The error one of Orbax's signal-waiting threads (of `signaling_thread_class`) ended with: a part of a
    save that failed (None while it runs, once it succeeded, or when it was cancelled).

    Public replacement: none (Orbax raises it only from ``result()``, which blocks until every part before it
    in the save has ended). Tested on orbax-checkpoint 0.12.8.
    """
    if thread.is_alive():
        return None
    error = getattr(thread, "_exception", None)
    return None if error is None or isinstance(error, concurrent.futures.CancelledError) else error


def cancel_signaling_thread(thread: threading.Thread) -> None:
    """Cancels one of Orbax's signal-waiting threads (of `signaling_thread_class`) and wakes it, by setting
    the signals it waits for to "cancelled" in the coordination service.

    Public replacement: none (Orbax cancels them itself only on its own errors). Tested on
    orbax-checkpoint 0.12.8.
    """
    from orbax.checkpoint._src.futures import signaling_client

    client = signaling_client.get_signaling_client()
    contract = future.AwaitableSignalsContract
    t: Any = thread
    t._cancelled = True  # read by _SignalingThread.run once its wait ends
    for signal in getattr(t, "_receive_signals", ()):
        key = contract.get_unique_awaitable_singal_key(signal, t._operation_id)
        client.key_value_set(key, "cancelled", allow_overwrite=True)
