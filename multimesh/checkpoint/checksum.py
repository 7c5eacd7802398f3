"""Layout-independent checksums of (sharded) arrays, computed shard by shard.

Why: a flipped byte inside a data file of an Orbax 0.12 checkpoint is restored
without any error (TensorStore checks the OCDBT manifest and b-tree nodes, not
the chunk data), so silently wrong values would come back. We record one
checksum per leaf at save time and verify it after restore.

The checksum must not depend on the layout, since a checkpoint is restored onto
other meshes and device counts. Format 2 (``ALGORITHM``), all integer
arithmetic, so exact and deterministic:

* the element bits are cut into words: 4-, 8- and 16-byte elements into
  ``uint32`` words (8-byte ones low word first), 2- and 1-byte elements are
  one word each (zero-extended);
* ``row`` is the element's flat index over the leading dimensions, ``col`` the
  word's index along the last dimension (element index * words per element);
* every word gives the term ``t = (word * wc(col)) mod 2**32``, with ``wc``
  an odd 32-bit hash of ``col``;
* ``S(row) = sum over col of t * 2**(32 * (col % 2))  mod 2**64`` (even and
  odd words share a 64-bit lane, which numpy sums without conversions);
* ``checksum = sum over row of S(row) * wr(row)  mod 2**64`` with ``wr`` an odd
  64-bit hash (splitmix64) of ``row``.

Every sum can be split anywhere: each shard adds its rows' partial ``S`` times
``wr``, and the shards of a leaf, of a process and of all processes are summed
modulo 2**64, in any order, so the value is the same on every mesh.

What it catches: any change confined to one word (a flipped bit or byte) is
always caught (``x -> x * w`` is a bijection modulo 2**32 for odd ``w``, the
term then moves ``S`` by less than 2**64, and an odd ``wr`` is invertible
modulo 2**64); random changes of many words (a garbled block, a truncated or
zero-filled chunk) and moved or swapped values are missed with a chance of
about 2**-32. Like any weighted sum modulo a power of two (and like format 1),
it cannot see changes that cancel exactly, e.g. the top bit flipped in two
words of the same row and lane parity.

Where it runs: a shard in host memory (CPU devices, and the host buffers that
checkpoint reads land in) is hashed by numpy in a thread pool, in blocks that
stay in cache (~4 GB/s per core, GIL released), overlapped with the I/O; a
shard on an accelerator is reduced on its device by a small jitted kernel
(dispatched asynchronously) and only its per-row sums come to the host.

Format 1 (checkpoints written before, ``checksums_v1``) summed 64-bit words in
numpy on one core; it is kept to verify those checkpoints.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .tree import is_prng_key

#: Name of the current checksum format, recorded in checkpoints.
ALGORITHM = "rowcol32-sum64/2"
#: Name of the format of checkpoints written before ``ALGORITHM``.
ALGORITHM_V1 = "sum64/1"

_MASK = (1 << 64) - 1
_ROW_SALT = 0x9E3779B97F4A7C15
_COL_SALT = 0x7F4A7C15
_BLOCK_WORDS = 1 << 18  # 1 MiB of uint32 temporaries: few calls, still in cache
_LITTLE_ENDIAN = sys.byteorder == "little"

HashableIndex = tuple[tuple[int, int], ...]


# ---------------------------------------------------------------- weights
def _splitmix64(idx: np.ndarray, salt: int) -> np.ndarray:
    """Odd splitmix64 hashes of non-negative integer indices (uint64)."""
    with np.errstate(over="ignore"):
        z = idx.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(salt)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)


def _fmix32(c: Any, xp: Any = np) -> Any:
    """Odd 32-bit hashes of uint32 word indices (murmur3's finaliser);
    ``xp`` is numpy or jax.numpy: both wrap modulo 2**32."""
    u = xp.uint32
    z = (c + u(_COL_SALT)) * u(0x9E3779B1)
    z = z ^ (z >> u(16))
    z = z * u(0x85EBCA6B)
    z = z ^ (z >> u(13))
    z = z * u(0xC2B2AE35)
    z = z ^ (z >> u(16))
    return z | u(1)


@functools.lru_cache(maxsize=512)
def _col_weights(start: int, n: int) -> np.ndarray:
    """``wc`` of words ``start .. start + n`` (read-only, cached)."""
    c = (np.arange(start, start + n, dtype=np.uint64) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    with np.errstate(over="ignore"):
        w = _fmix32(c)
    w.flags.writeable = False
    return w


@functools.lru_cache(maxsize=512)
def _row_weights(lead: tuple[int, ...], box: HashableIndex) -> np.ndarray:
    """``wr`` of the rows of the box ``box`` (ranges over the leading dims
    ``lead``), in C order (read-only, cached)."""
    rows = np.zeros((), np.uint64)
    stride = 1
    for n, (a, b) in reversed(list(zip(lead, box))):
        rows = (np.arange(a, b, dtype=np.uint64) * np.uint64(stride))[:, None] + rows.reshape(1, -1)
        stride *= n
    w = _splitmix64(rows.reshape(-1), _ROW_SALT)
    w.flags.writeable = False
    return w


# ------------------------------------------------------------------ words
def words_per_element(dtype: np.dtype) -> tuple[np.dtype, int]:
    """The unsigned word type and the number of words per element of ``dtype``."""
    size = np.dtype(dtype).itemsize
    if size % 4 == 0:
        return np.dtype(np.uint32), size // 4
    if size % 2 == 0:
        return np.dtype(np.uint16), size // 2
    return np.dtype(np.uint8), size


def _as_words(a: np.ndarray) -> np.ndarray:
    """``a`` (C-contiguous, ndim >= 1) as a 2-D (rows, cols) array of words."""
    word, per = words_per_element(a.dtype)
    a = np.ascontiguousarray(a)
    rows = int(np.prod(a.shape[:-1], dtype=np.int64))
    return a.reshape(-1).view(word).reshape(rows, a.shape[-1] * per)


def _tile_sums(words: np.ndarray, col_start: int, tmp: np.ndarray) -> np.ndarray:
    """``S`` (uint64, one per row) of a 2-D block of words starting at global
    word ``col_start``, using the scratch buffer ``tmp`` (uint32, C order, at
    least ``rows x (cols + 2)``).

    The per-word terms are laid out so that global word pairs (even, odd) share
    one uint64 lane: a little-endian uint64 view then sums ``t_even + 2**32 *
    t_odd`` with no casts."""
    rows, cols = words.shape
    off = col_start & 1
    width = off + cols + ((off + cols) & 1)
    buf = tmp.reshape(-1)[:rows * width].reshape(rows, width)
    if off:
        buf[:, 0] = 0
    if width > off + cols:
        buf[:, -1] = 0
    np.multiply(words, _col_weights(col_start, cols), out=buf[:, off:off + cols])
    return np.add.reduce(buf.view(np.uint64), axis=1)


def row_sums(words: np.ndarray, col_start: int) -> np.ndarray:
    """``S`` (uint64, one per row) of a 2-D array of words whose first column
    is word ``col_start`` of the global last dimension:
    ``S(row) = sum over col of t(row, col) * 2**(32 * (col % 2))  mod 2**64``
    with ``t = (word * wc(col)) mod 2**32``."""
    rows, cols = words.shape
    out = np.zeros(rows, np.uint64)
    if rows == 0 or cols == 0:
        return out
    if not _LITTLE_ENDIAN:  # pragma: no cover - no big-endian hosts here
        wc = _col_weights(col_start, cols)
        with np.errstate(over="ignore"):
            t = (words.astype(np.uint32) * wc).astype(np.uint64)
        shift = (np.arange(col_start, col_start + cols, dtype=np.uint64) & np.uint64(1)) * np.uint64(32)
        return np.add.reduce(t << shift, axis=1, dtype=np.uint64)
    if cols > _BLOCK_WORDS:  # long rows: tiles along the row
        tmp = np.empty(_BLOCK_WORDS + 2, np.uint32)
        for r in range(rows):
            for c in range(0, cols, _BLOCK_WORDS):
                out[r:r + 1] += _tile_sums(words[r:r + 1, c:c + _BLOCK_WORDS], col_start + c, tmp)
        return out
    step = max(1, _BLOCK_WORDS // cols)
    tmp = np.empty(min(step, rows) * (cols + 2), np.uint32)
    for r in range(0, rows, step):
        out[r:r + step] = _tile_sums(words[r:r + step], col_start, tmp)
    return out


def combine_rows(sums: np.ndarray, box: HashableIndex, shape: tuple[int, ...]) -> int:
    """``sum S(row) * wr(row) mod 2**64`` for the rows of ``box`` in an array of ``shape``."""
    if sums.size == 0:
        return 0
    wr = _row_weights(tuple(shape[:-1]), tuple(box[:-1]))
    return int(np.multiply(sums, wr).sum(dtype=np.uint64))


def box_of(index: Sequence[Any], shape: Sequence[int]) -> HashableIndex:
    """``((start, stop), ...)`` of a shard index (a tuple of slices) in ``shape``."""
    box = []
    for sl, n in zip(index, shape):
        if isinstance(sl, slice):
            a, b, _ = sl.indices(n)
        else:
            a, b = int(sl), int(sl) + 1
        box.append((a, b))
    box += [(0, n) for n in shape[len(box):]]
    return tuple(box)


def host_sum(data: np.ndarray, box: HashableIndex, shape: tuple[int, ...]) -> int:
    """Checksum contribution (mod 2**64) of the host block ``data`` at ``box``
    in an array of ``shape``."""
    if len(shape) == 0:
        shape, box, data = (1,), ((0, 1),), np.reshape(data, (1,))
    if data.size == 0:
        return 0
    _, per = words_per_element(data.dtype)
    sums = row_sums(_as_words(data), box[-1][0] * per)
    return combine_rows(sums, box, shape) & _MASK


# ------------------------------------------------------------ device kernel
def _device_supported(dtype: Any) -> bool:
    """Whether ``_device_row_sums`` handles ``dtype``: bool, and integer and
    floating types whose bits fill 1, 2, 4 or 8 bytes (8 only with x64)."""
    import jax.numpy as jnp

    if not any(jnp.issubdtype(dtype, k) for k in (jnp.bool_, jnp.integer, jnp.floating)):
        return False
    size = np.dtype(dtype).itemsize
    return (size in (1, 2, 4, 8) and jax.dtypes.itemsize_bits(dtype) == 8 * size
            and (size != 8 or jax.config.jax_enable_x64))


#: Columns per chunk in the device kernel: sums of 16-bit halves of at most
#: 2**16 terms are exact in uint32.
_DEVICE_CHUNK = 1 << 16


@functools.partial(jax.jit, static_argnames=("per",))
def _device_row_sums(x: jax.Array, col_start: jax.Array, per: int) -> tuple[jax.Array, ...]:
    """The pieces of ``S`` of one shard, computed on its device with uint32
    arithmetic only (no x64 needed): per row and chunk of columns, the sums of
    the low and high 16 bits of the even-column terms (exact) and the sum of
    the odd-column terms (mod 2**32, all that ``S`` keeps of them)."""
    import jax.numpy as jnp
    from jax import lax

    if x.ndim == 0:
        x = x.reshape(1)
    size = x.dtype.itemsize
    if x.dtype == jnp.bool_:
        w = x.astype(jnp.uint32)[..., None]
    elif size == 8:  # low word first, as in a little-endian host view
        u = lax.bitcast_convert_type(x, jnp.uint64)
        w = jnp.stack([(u & jnp.uint64(0xFFFFFFFF)).astype(jnp.uint32),
                       (u >> jnp.uint64(32)).astype(jnp.uint32)], axis=-1)
    else:
        w = lax.bitcast_convert_type(x, {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[size])
        w = w.astype(jnp.uint32)[..., None]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    cols = x.shape[-1] * per
    w = w.reshape(rows, cols)
    c = col_start + lax.iota(jnp.uint32, cols)
    t = w * _fmix32(c, jnp)
    even = (c & jnp.uint32(1)) == 0
    zero = jnp.uint32(0)
    te, to = jnp.where(even, t, zero), jnp.where(even, zero, t)
    chunks = -(-cols // _DEVICE_CHUNK)
    if chunks > 1:
        pad = ((0, 0), (0, chunks * _DEVICE_CHUNK - cols))
        te, to = jnp.pad(te, pad), jnp.pad(to, pad)
    te = te.reshape(rows, chunks, -1)
    to = to.reshape(rows, chunks, -1)
    return (jnp.sum(te & jnp.uint32(0xFFFF), axis=-1, dtype=jnp.uint32),
            jnp.sum(te >> jnp.uint32(16), axis=-1, dtype=jnp.uint32),
            jnp.sum(to, axis=-1, dtype=jnp.uint32))


def _device_pieces_to_sums(lo: np.ndarray, hi: np.ndarray, odd: np.ndarray) -> np.ndarray:
    u = np.uint64
    with np.errstate(over="ignore"):
        s = lo.astype(u) + (hi.astype(u) << u(16)) + (odd.astype(u) << u(32))
    return np.add.reduce(s, axis=1, dtype=np.uint64)


def device_sum_start(data: jax.Array, box: HashableIndex, shape: tuple[int, ...]) -> Callable[[], int]:
    """Dispatches the kernel on ``data``'s device now; returns a function that
    waits for its per-row pieces and finishes the contribution on the host."""
    if len(shape) == 0:
        shape, box = (1,), ((0, 1),)
    if any(b <= a for a, b in box):
        return lambda: 0
    _, per = words_per_element(data.dtype)
    col_start = np.uint32((box[-1][0] * per) & 0xFFFFFFFF)
    pieces = _device_row_sums(data, col_start, per)

    def finish() -> int:
        sums = _device_pieces_to_sums(*(np.asarray(p) for p in pieces))
        return combine_rows(sums, box, shape) & _MASK

    return finish


# ------------------------------------------------------------- who hashes
@functools.lru_cache(maxsize=1024)
def _owned(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[HashableIndex, Any]:
    """The distinct shard boxes that this process hashes, each with the local
    device holding it. Of all devices (of all processes) holding the same box,
    the one with the lowest id hashes it, so every element counts exactly once."""
    owner: dict[HashableIndex, jax.Device] = {}
    # typed as the public jax.Device: the alias jax's own hints use is no type to mypy (jaxlib has no stubs)
    placed: Mapping[jax.Device, Any] = sharding.devices_indices_map(shape)
    for device, index in placed.items():
        box = box_of(index, shape)
        if box not in owner or device.id < owner[box].id:
            owner[box] = device
    me = jax.process_index()
    return {box: d for box, d in owner.items() if d.process_index == me}


def owned_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[HashableIndex, Any]:
    """Public view of ``_owned`` (shard box -> the local device that hashes it)."""
    return _owned(sharding, tuple(shape))


# ------------------------------------------------------------------- pool
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """The hashing threads (numpy releases the GIL): one per core, at most 8."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, min(8, os.cpu_count() or 1)),
                thread_name_prefix="multimesh-checksum")
        return _pool


def _batch_sums(items: list[tuple[np.ndarray, HashableIndex, tuple[int, ...]]]) -> list[int]:
    """``host_sum`` of many small blocks of the same shape, dtype and column
    parity, with a handful of numpy calls in all (per-call overheads dominate
    small blocks); the same lane layout as ``_tile_sums``."""
    word, per = words_per_element(items[0][0].dtype)
    data = np.stack([d for d, _, _ in items])
    k = data.shape[0]
    cols = data.shape[-1] * per
    words = data.reshape(k, -1).view(word).reshape(k, -1, cols)
    rows = words.shape[1]
    starts = [box[-1][0] * per for _, box, _ in items]
    off = starts[0] & 1
    width = off + cols + ((off + cols) & 1)
    buf = np.zeros((k, rows, width), np.uint32) if width != cols else np.empty((k, rows, width), np.uint32)
    wc = np.stack([_col_weights(c, cols) for c in starts])[:, None, :]
    np.multiply(words, wc, out=buf[:, :, off:off + cols])
    sums = np.add.reduce(buf.view(np.uint64), axis=2)
    wr = np.stack([_row_weights(tuple(shape[:-1]), tuple(box[:-1])) for _, box, shape in items])
    totals = np.add.reduce(np.multiply(sums, wr), axis=1)
    return [int(v) for v in totals]


class _Part:
    """One item's share of a batched future."""

    __slots__ = ("future", "index")

    def __init__(self, future: concurrent.futures.Future, index: int):
        self.future, self.index = future, index

    def result(self) -> int:
        return self.future.result()[self.index]


Partial = concurrent.futures.Future | _Part | int

#: Blocks of at least this many bytes are hashed alone (blocked, cache-sized
#: passes); smaller ones are batched with others of their shape and dtype.
_ALONE_BYTES = 1 << 20
#: Bytes of small blocks per batch (a batch's passes then stay in cache).
_BATCH_BYTES = 1 << 20


class Hasher:
    """Hashes host blocks and device shards of many arrays in the pool.

    ``add`` / ``add_device`` attribute a block's contribution to a key (an
    array, a leaf path); ``partials(key)`` lists the pieces, whose sum is the
    key's (local) checksum. Small host blocks wait to be batched until
    ``flush`` (called by ``partials``), or until a batch is full when
    ``eager``. Not thread-safe: one feeding thread.
    """

    def __init__(self, *, eager: bool = True):
        self._eager = eager
        self._parts: dict[Any, list[Partial]] = {}
        self._batches: dict[tuple, list] = {}
        self._batch_bytes: dict[tuple, int] = {}

    def _part(self, key: Any) -> list[Partial]:
        return self._parts.setdefault(key, [])

    def add(self, key: Any, data: np.ndarray, box: HashableIndex, shape: tuple[int, ...]) -> None:
        """Hashes the host block ``data`` at ``box`` of an array of ``shape``.
        ``data`` must not change until the key's result is taken."""
        parts = self._part(key)
        if len(shape) == 0:
            shape, box, data = (1,), ((0, 1),), np.reshape(data, (1,))
        if data.size == 0:
            return
        if data.nbytes >= _ALONE_BYTES:
            parts.append(pool().submit(host_sum, data, box, shape))
            return
        group = (data.shape, data.dtype, box[-1][0] * words_per_element(data.dtype)[1] & 1)
        batch = self._batches.setdefault(group, [])
        batch.append((key, data, box, shape))
        self._batch_bytes[group] = self._batch_bytes.get(group, 0) + data.nbytes
        if self._eager and self._batch_bytes[group] >= _BATCH_BYTES:
            self._flush(group)

    def add_device(self, key: Any, data: jax.Array, box: HashableIndex, shape: tuple[int, ...]) -> None:
        """Reduces the single-device array ``data`` (at ``box``) on its device:
        the kernel is dispatched now, the host part runs in the pool."""
        self._part(key).append(pool().submit(device_sum_start(data, box, shape)))

    def _flush(self, group: tuple) -> None:
        batch = self._batches.pop(group)
        self._batch_bytes.pop(group)
        chunk: list = []
        size = 0
        for item in batch + [None]:  # batches of about _BATCH_BYTES
            if chunk and (item is None or size >= _BATCH_BYTES):
                future = pool().submit(_batch_sums, [(d, b, s) for _, d, b, s in chunk])
                for i, (key, _, _, _) in enumerate(chunk):
                    self._parts[key].append(_Part(future, i))
                chunk, size = [], 0
            if item is not None:
                chunk.append(item)
                size += item[1].nbytes

    def flush(self) -> None:
        """Submits the small blocks still waiting for a batch."""
        for group in list(self._batches):
            self._flush(group)

    def partials(self, key: Any) -> list[Partial]:
        """The pieces of ``key``'s checksum (empty: nothing of it is local)."""
        self.flush()
        return self._parts.get(key, [])


def start(arrays: Sequence[jax.Array], *, on_device: bool | None = None) -> list[list[Partial]]:
    """Starts hashing the locally owned shards of every array; returns, per
    array, the pieces of its local checksum (see ``finish``).

    CPU shards are viewed in place (no copy) and hashed by the pool;
    accelerator shards are reduced on their devices by kernels dispatched
    before this returns (``on_device`` forces one way or the other, for
    tests). Either way the arrays may be donated or deleted once it returns.
    """
    hasher = Hasher(eager=False)  # batches go out at the end: no GIL contention meanwhile
    for i, x in enumerate(arrays):
        if is_prng_key(x.dtype):
            x = jax.random.key_data(x)
        shape = tuple(int(d) for d in x.shape)
        owned = _owned(x.sharding, shape)
        device_ok = None  # looked up once, only for a leaf with accelerator shards
        hasher._part(i)
        for shard in x.addressable_shards:
            box = _box_cached(shard.index, shape)
            if owned.get(box) != shard.device:
                continue
            use_device = (shard.device.platform != "cpu") if on_device is None else on_device
            if use_device and device_ok is None:
                device_ok = _device_supported(x.dtype)
            if use_device and device_ok:
                hasher.add_device(i, shard.data, box, shape)
            else:
                hasher.add(i, np.asarray(shard.data), box, shape)
    return [hasher.partials(i) for i in range(len(arrays))]


@functools.lru_cache(maxsize=4096)
def _box_cached(index: tuple, shape: tuple[int, ...]) -> HashableIndex:
    return box_of(index, shape)


def finish(partials: Iterable[Iterable[Partial]]) -> list[str]:
    """Waits for the pieces of every array's checksum and adds them up (and,
    with several processes, every process's share: a collective, so every
    process calls it with the same arrays in the same order). Hex strings."""
    local = []
    for parts in partials:
        total = 0
        for p in parts:
            total += p if isinstance(p, int) else p.result()
        local.append(total & _MASK)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        halves = np.array([[v >> 32, v & 0xFFFFFFFF] for v in local], dtype=np.uint32).reshape(-1, 2)
        gathered = np.asarray(multihost_utils.process_allgather(halves))
        local = [
            sum((int(p[i, 0]) << 32) | int(p[i, 1]) for p in gathered) & _MASK
            for i in range(len(local))
        ]
    return [f"{v:016x}" for v in local]


def checksums(arrays: Sequence[jax.Array]) -> list[str]:
    """Checksums (hex strings, format ``ALGORITHM``) of global arrays; a
    collective over processes."""
    return finish(start(arrays))


# ------------------------------------------------------------ format 1
_V1_ROW_SALT = 0x9E3779B97F4A7C15
_V1_COL_SALT = 0xD1B54A32D192ED03
_V1_BLOCK_ELEMENTS = 1 << 16


def _v1_as_words(block: np.ndarray) -> tuple[np.ndarray, int]:
    block = np.ascontiguousarray(block)
    size = block.dtype.itemsize
    word = next(w for w in (8, 4, 2, 1) if size % w == 0)
    return block.view(np.dtype(f"uint{8 * word}")), size // word


def _v1_shard_sum(data: np.ndarray, index: tuple, shape: tuple[int, ...]) -> int:
    if len(shape) == 0:
        shape, index, data = (1,), (slice(None),), np.reshape(data, (1,))
    starts = [sl.indices(n)[0] if isinstance(sl, slice) else int(sl) for sl, n in zip(index, shape)]
    stops = [sl.indices(n)[1] if isinstance(sl, slice) else int(sl) + 1 for sl, n in zip(index, shape)]
    words, per = _v1_as_words(data)
    lead = shape[:-1]
    if lead:
        grids = np.meshgrid(*[np.arange(a, b) for a, b in zip(starts[:-1], stops[:-1])], indexing="ij")
        rows = np.ravel_multi_index([g.ravel() for g in grids], lead) if grids[0].size else np.zeros(0, int)
    else:
        rows = np.zeros(1, dtype=np.int64)
    cols = np.arange(starts[-1] * per, stops[-1] * per)
    if rows.size == 0 or cols.size == 0:
        return 0
    words = words.reshape(rows.size, cols.size)
    w_row = _splitmix64(rows, _V1_ROW_SALT)
    w_col = _splitmix64(cols, _V1_COL_SALT)
    total = 0
    step = max(1, _V1_BLOCK_ELEMENTS // cols.size)
    with np.errstate(over="ignore"):
        for i in range(0, rows.size, step):
            blk = words[i:i + step].astype(np.uint64)
            blk ^= w_col
            blk *= w_col
            per_row = blk.sum(axis=1, dtype=np.uint64) * w_row[i:i + step]
            total += int(per_row.sum(dtype=np.uint64))
    return total & _MASK


def checksums_v1(arrays: Sequence[jax.Array]) -> list[str]:
    """Format-1 checksums (``ALGORITHM_V1``), to verify checkpoints written
    before format 2: a sum over every element of
    ``((bits ^ w_col(col)) * w_col(col)) * w_row(row)`` modulo 2**64, with
    64-bit words and weights, on one host core."""
    partials = []
    for x in arrays:
        if is_prng_key(x.dtype):
            x = jax.random.key_data(x)
        total = 0
        for shard in x.addressable_shards:
            if shard.replica_id == 0:
                total += _v1_shard_sum(np.asarray(shard.data), shard.index, tuple(x.shape))
        partials.append([total & _MASK])
    return finish(partials)
