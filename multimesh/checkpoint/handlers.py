"""The Orbax handlers behind ``CheckpointManager`` (same files as Orbax's own).

* ``StateHandler``: Orbax's ``StandardCheckpointHandler`` with compression as
  an option and our ``ArrayHandler``, which reads arrays leaner than Orbax
  0.12 does and hashes what it reads while the rest is still being read.
* ``DocHandler``: Orbax's ``JsonCheckpointHandler`` whose document may be a
  ``PendingDoc``: its checksums are filled in by the background commit, once
  the hashing that runs alongside the array writes is done.

The save path is Orbax's, with two per-shard costs removed (found by
profiling a 2,000-leaf save; together ~15% of its time on tmpfs): in one
process, no replica-parallel writes (every replica is local; Orbax would cut
each replicated shard into one jitted slice per replica), and a byte limiter
with Orbax's limit but without its debug-log lines, whose sizes Orbax formats
on every reservation even with the log off.

Both report Orbax's own ``typestr``, so a step's ``_CHECKPOINT_METADATA`` is
what raw Orbax writes and either can read the other's checkpoints.

Why a read path of our own (measured in ``benchmarks/checkpoint_io.py``):
Orbax 0.12 spends about 1 ms of Python per shard on a restore (byte limiter,
footprint estimates, one ``device_put`` per shard...), so a state of 2,000
small leaves restores at a few MB/s, and it reads every shard into a fresh
unaligned buffer that ``device_put`` then copies once more. Here each leaf is
one TensorStore open; a small, fully addressable leaf is one read; any other
is read shard by shard (each distinct shard once). Reads land in 64-byte
aligned buffers that CPU devices adopt without a copy (local replicas share
one, as after ``jax.device_put``). Everything else (PRNG keys, dtype
conversions, non-OCDBT checkpoints, shape changes) goes through Orbax's path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from .._compat.orbax import (
    JsonHandlerPreparingWrites,
    LeanByteLimit,
    array_metadata_store,
    array_read_spec,
    handler_metadata_key,
    is_orbax_byte_limiter,
    use_pytree_handler,
)
from . import checksum as _checksum
from .stage_local import StageLocalSerialize
from .tree import is_prng_key, leaves_with_paths, path_str

#: A fully addressable leaf up to this size is read in one piece and placed
#: with one ``device_put`` (per-shard reads cost more than the extra copy).
WHOLE_LEAF_BYTES = 4 << 20
_ALIGN = 64  # what XLA:CPU needs to adopt a host buffer without copying
#: Bytes of reads in flight at once (None: no limit; a larger read goes
#: alone): blocks then arrive one after the other and are hashed while the
#: next ones are read, instead of all at the end.
READ_BYTES_IN_FLIGHT: int | None = 64 << 20


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-order array whose data is 64-byte aligned."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + n].view(dtype).reshape(shape)


class ArrayHandler(StageLocalSerialize, ocp.type_handlers.ArrayHandler):
    """Orbax's ``jax.Array`` handler with a leaner read path, that also saves the
    arrays of pipeline stages held by one process of several (`StageLocalSerialize`).

    ``hasher``: while set (by the manager, around one restore), every block
    read on the lean path is also hashed, under the leaf's path, by this
    ``checksum.Hasher``; ``hashed`` collects those paths.
    """

    def __init__(self) -> None:
        # Orbax's per-process write-shape records: its commit wants every array's record on process 0,
        # which does not write (nor record) the arrays of pipeline stages on other processes.
        single = jax.process_count() == 1
        store = array_metadata_store() if single else None
        # Replica-parallel writes let the hosts holding replicas of a shard write a part each; in one
        # process every replica is here, and splitting costs a jitted slice per replica and shard
        # (a replicated (512,) vector on a 4x2 mesh: 8 slices).
        super().__init__(array_metadata_store=store, use_replica_parallel=False if single else None)
        self.hasher: _checksum.Hasher | None = None
        self.hashed: set[str] = set()

    async def serialize(self, values: Sequence[Any], infos: Sequence[Any], args: Sequence[Any] | None = None) -> list:
        leaner: dict[int, LeanByteLimit] = {}

        def lean(info: Any) -> Any:
            limiter = getattr(info, "byte_limiter", None)
            if limiter is None or not is_orbax_byte_limiter(limiter):
                return info
            if id(limiter) not in leaner:
                leaner[id(limiter)] = LeanByteLimit(limiter.max_bytes)
            return info.replace(byte_limiter=leaner[id(limiter)])

        return await super().serialize(values, [lean(i) for i in infos], args)

    async def deserialize(self, infos: Sequence[Any], args: Sequence[Any] | None = None) -> list:
        if args is None:
            return list(await super().deserialize(infos, args))
        await asyncio.gather(*[info.await_path_creation() for info in infos])
        out: list = [None] * len(infos)
        for i, arg in enumerate(args):  # a pipeline stage on other processes: they read it
            if _held_elsewhere(arg):
                out[i] = jax.make_array_from_single_device_arrays(arg.global_shape, arg.sharding, [],
                                                                  dtype=arg.dtype)
        here = [i for i in range(len(infos)) if out[i] is None]
        lean = [i for i in here if _lean_candidate(infos[i], args[i])]
        stores = await _gather([_open(infos[i], args[i], handler_metadata_key(self)) for i in lean])
        opened = {i: t for i, t in zip(lean, stores) if t is not None}
        fallback = [i for i in here if i not in opened]
        hasher = self.hasher
        budget = _ByteBudget(READ_BYTES_IN_FLIGHT)

        async def read(i: int) -> None:
            out[i] = await self._read(infos[i], args[i], opened[i], hasher, budget)

        async def orbax_path() -> None:
            if fallback:
                got = await super(ArrayHandler, self).deserialize(
                    [infos[i] for i in fallback], [args[i] for i in fallback])
                for i, x in zip(fallback, got):
                    out[i] = x

        await _gather([orbax_path(), *[read(i) for i in opened]])
        return out

    async def _read(self, info: Any, arg: Any, t: ts.TensorStore,
                    hasher: _checksum.Hasher | None, budget: _ByteBudget) -> jax.Array:
        """One leaf, read into aligned host buffers (hashed when ``hasher``)
        and placed on ``arg.sharding``."""
        shape = tuple(int(d) for d in t.shape)
        sharding = arg.sharding
        dtype = t.dtype.numpy_dtype
        key = path_str(info.keypath) if info.keypath is not None else info.name
        if hasher is not None:
            self.hashed.add(key)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes <= WHOLE_LEAF_BYTES and sharding.is_fully_addressable:
            # one read; the devices get slices of it (replicas share one, as
            # with jax.device_put: XLA:CPU never writes into adopted memory)
            host = aligned_empty(shape, dtype)
            async with budget(host.nbytes):
                await ts.array(host).write(t)
            if hasher is not None:
                hasher.add(key, host, tuple((0, n) for n in shape), shape)
            return jax.make_array_from_callback(shape, sharding, lambda index: host[index])

        owned = _checksum.owned_boxes(sharding, shape) if hasher is not None else {}
        boxes = _local_boxes(sharding, shape)
        bufs: dict[_checksum.HashableIndex, np.ndarray] = {}

        async def one(box: _checksum.HashableIndex) -> None:
            index, devices = boxes[box]
            buf = bufs[box] = aligned_empty(tuple(b - a for a, b in box), dtype)
            domain = ts.IndexDomain(shape=shape)[ts.d[:][index]]
            await ts.array(buf)[ts.d[:].translate_to[domain.origin]].write(t[domain])
            if hasher is not None and owned.get(box) in devices:
                hasher.add(key, buf, box, shape)

        async def together(group: list) -> None:
            # shards that need the same stored chunks are read at the same
            # time, so that TensorStore reads each chunk once for all of them
            async with budget(sum(int(np.prod([b - a for a, b in box])) for box in group) * dtype.itemsize):
                await _gather([one(box) for box in group])

        chunk = tuple(max(1, int(c)) for c in t.chunk_layout.read_chunk_template.shape)
        await _gather([together(g) for g in _sharing_chunks(list(boxes), chunk)])
        if not boxes:  # a pipeline stage on other processes: they read it; a placeholder here
            return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)
        return jax.make_array_from_callback(
            shape, sharding, lambda index: bufs[_checksum.box_of(_shard_index(index), shape)])


class _ByteBudget:
    """Lets reads start in order, with at most ``limit`` bytes in flight
    (None: no limit); a read larger than the limit runs alone.
    ``async with budget(nbytes): ...`` holds ``nbytes`` of it."""

    def __init__(self, limit: int | None):
        self._limit = limit
        self._used = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def _fits(self, nbytes: int) -> bool:
        return self._used == 0 or self._limit is None or self._used + nbytes <= self._limit

    @contextlib.asynccontextmanager
    async def __call__(self, nbytes: int):
        if self._limit is None:
            yield
            return
        if self._waiting or not self._fits(nbytes):
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append((nbytes, turn))
            await turn  # the releaser counted our bytes in
        else:
            self._used += nbytes
        try:
            yield
        finally:
            self._used -= nbytes
            while self._waiting and self._fits(self._waiting[0][0]):
                n, turn = self._waiting.popleft()
                self._used += n
                turn.set_result(None)


def _sharing_chunks(boxes: list, chunk: tuple[int, ...]) -> list[list]:
    """``boxes`` grouped so that boxes touching a common stored chunk (of
    shape ``chunk``) are in the same group (connected components)."""
    cells = [tuple((a // c, -(-b // c)) for (a, b), c in zip(box, chunk)) for box in boxes]
    parent = list(range(len(boxes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(boxes)):
        for j in range(i):
            if all(a1 < b2 and a2 < b1 for (a1, b1), (a2, b2) in zip(cells[i], cells[j])):
                parent[root(i)] = root(j)
    groups: dict[int, list] = {}
    for i, box in enumerate(boxes):
        groups.setdefault(root(i), []).append(box)
    return list(groups.values())


@functools.lru_cache(maxsize=1024)
def _local_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict:
    """The distinct shard boxes on this process's devices: box -> (index, devices)."""
    by_box: dict[_checksum.HashableIndex, tuple[tuple, list]] = {}
    for device, given in sharding.addressable_devices_indices_map(shape).items():
        index = _shard_index(given)
        box = _checksum.box_of(index, shape)
        by_box.setdefault(box, (index, []))[1].append(device)
    return by_box


def _shard_index(index: tuple[slice, ...] | None) -> tuple[slice, ...]:
    """A shard's index as JAX hands it: its hints allow None, which it never gives for a shard."""
    if index is None:
        raise ValueError("JAX gave no index for a shard of an array; a shard's index is a tuple of slices")
    return index


async def _gather(coros: list) -> list:
    """``asyncio.gather`` that lets every operation finish before raising the
    first error (TensorStore callbacks must not outlive Orbax's event loop)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _held_elsewhere(arg: Any) -> bool:
    """A restore target with no device in this process (and the shape and dtype to stand for it)."""
    sharding = getattr(arg, "sharding", None)
    return (isinstance(sharding, jax.sharding.Sharding) and not sharding.addressable_devices
            and getattr(arg, "global_shape", None) is not None and getattr(arg, "dtype", None) is not None)


def _lean_candidate(info: Any, arg: Any) -> bool:
    """Whether a leaf may take the lean read path (checked before opening it)."""
    if not isinstance(arg, ocp.type_handlers.ArrayRestoreArgs):
        return False
    if type(arg) is not ocp.type_handlers.ArrayRestoreArgs:  # e.g. single-replica restores
        return False
    if arg.mesh is not None or not isinstance(arg.sharding, jax.sharding.Sharding):
        return False
    if arg.dtype is not None and is_prng_key(arg.dtype):
        return False
    return bool(info.is_ocdbt_checkpoint) and info.name is not None and info.parent_dir is not None


async def _open(info: Any, arg: Any, metadata_key: str | None) -> ts.TensorStore | None:
    """The leaf's TensorStore, or None when it needs Orbax's path (another
    shape or dtype than stored, an empty or a scalar non-addressable array)."""
    t = await ts.open(array_read_spec(info, metadata_key), open=True, context=info.ts_context)
    shape = tuple(int(d) for d in t.shape)
    want = arg.global_shape if arg.global_shape is not None else arg.shape
    if want is not None and tuple(want) != shape:
        return None
    if arg.dtype is not None and np.dtype(arg.dtype) != t.dtype.numpy_dtype:
        return None
    if 0 in shape or (not shape and not arg.sharding.is_fully_addressable):
        return None
    return t


def _type_registry(array_handler: ArrayHandler) -> Any:
    """Orbax's default type handlers, with ours for ``jax.Array``."""
    handlers = []
    for ty in ocp.type_handlers.supported_types():
        handlers.append((ty, array_handler if ty is jax.Array else ocp.type_handlers.get_type_handler(ty)))
    return ocp.type_handlers.create_type_handler_registry(*handlers)


@dataclasses.dataclass
class SubsetRestore(ocp.args.CheckpointArgs):
    """Restore only some leaves of a saved state: ``leaves`` maps each wanted
    leaf's saved path (``params/Dense_0/kernel``) to its target
    (``ShapeDtypeStruct`` with a sharding). The restored value is the same
    mapping, with the arrays (a path absent from the files is left out)."""

    leaves: dict[str, jax.ShapeDtypeStruct]


class StateHandler(ocp.StandardCheckpointHandler):
    """``StandardCheckpointHandler`` with our array handler and a choice of
    zstd compression (Orbax's default is on); it also restores a subset of
    the saved leaves (``SubsetRestore``), reading only those."""

    def __init__(self, *, compression: bool):
        super().__init__()
        self.arrays = ArrayHandler()
        self._pytree = ocp.PyTreeCheckpointHandler(
            use_compression=compression, type_handler_registry=_type_registry(self.arrays))
        use_pytree_handler(self, self._pytree)

    @classmethod
    def typestr(cls) -> str:
        return ocp.StandardCheckpointHandler.typestr()

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        if isinstance(args, SubsetRestore):
            return self._restore_subset(directory, args.leaves)
        return super().restore(directory, item, args)

    def _restore_subset(self, directory: Any, leaves: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        """The saved tree's structure (Orbax's metadata) with every leaf but
        the wanted ones a placeholder, which Orbax skips without reading it."""
        saved = self._pytree.metadata(directory).tree
        item = jax.tree_util.tree_map_with_path(
            lambda keypath, _: leaves.get(path_str(keypath), ocp.PLACEHOLDER), saved)
        restored = self._pytree.restore(directory, args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item)))
        return {p: x for p, x in leaves_with_paths(restored) if p in leaves}


class PendingDoc(dict):
    """A JSON document to be completed by ``fill`` in the background commit
    (the dict itself is complete but for what ``fill`` adds)."""

    def __init__(self, doc: dict, fill: Callable[[dict], None]):
        super().__init__(doc)
        self._fill = fill

    def resolve(self) -> dict:
        doc = dict(self)
        self._fill(doc)
        return doc


class DocHandler(JsonHandlerPreparingWrites):
    """``JsonCheckpointHandler`` that completes a ``PendingDoc`` when it writes."""

    async def prepare(self, x: Any) -> Any:
        return await asyncio.to_thread(x.resolve) if isinstance(x, PendingDoc) else x

    @classmethod
    def typestr(cls) -> str:
        return ocp.JsonCheckpointHandler.typestr()


def registry(state: StateHandler, doc: DocHandler, state_item: str, doc_item: str) -> Any:
    """An Orbax handler registry for our two items."""
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    reg.add(state_item, ocp.args.StandardSave, state)
    reg.add(state_item, ocp.args.StandardRestore, state)
    reg.add(state_item, SubsetRestore, state)
    reg.add(doc_item, ocp.args.JsonSave, doc)
    reg.add(doc_item, ocp.args.JsonRestore, doc)
    return reg
