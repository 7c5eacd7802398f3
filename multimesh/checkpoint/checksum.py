"""A layout-independent checksum of a (sharded) ``jax.Array``'s bits.

Why: a flipped byte inside a data file of an Orbax 0.12 checkpoint is restored
without any error (TensorStore checks the OCDBT manifest and b-tree nodes, not
the chunk data), so silently wrong values would come back. We record one
checksum per leaf at save time and verify it after restore.

The checksum must not depend on the layout, since a checkpoint is restored onto
other meshes: it is a sum, modulo 2**64, over every element of
``((bits ^ w_col(col)) * w_col(col)) * w_row(row)``, where ``bits`` are the element's
raw bits as an unsigned integer, ``row`` is the element's flat index over the
leading dimensions, ``col`` its index in the last dimension, and the weights
are odd 64-bit hashes of the indices. A sum can be computed shard by shard (the
shards with ``replica_id == 0`` cover the array exactly once) and across
processes; any change of a single element is always detected (odd weights are
invertible modulo 2**64) and moved or swapped values almost always. It runs on
the host with numpy at roughly 2 GB/s on one core; nothing is compiled.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from .tree import is_prng_key

_MASK = (1 << 64) - 1
_ROW_SALT = 0x9E3779B97F4A7C15
_COL_SALT = 0xD1B54A32D192ED03
_BLOCK_ELEMENTS = 1 << 16


def _weights(idx: np.ndarray, salt: int) -> np.ndarray:
    """Odd splitmix64 hashes of integer indices."""
    with np.errstate(over="ignore"):
        z = idx.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(salt)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)


def _as_words(block: np.ndarray) -> tuple[np.ndarray, int]:
    """The block's bytes as unsigned words (≤ 8 bytes); words per element."""
    block = np.ascontiguousarray(block)
    size = block.dtype.itemsize
    word = next(w for w in (8, 4, 2, 1) if size % w == 0)
    words = block.view(np.dtype(f"uint{8 * word}"))
    return words, size // word


def _shard_sum(data: np.ndarray, index: tuple, shape: tuple[int, ...]) -> int:
    """Checksum contribution of one shard ``data`` at ``index`` in an array of ``shape``."""
    if len(shape) == 0:
        shape, index, data = (1,), (slice(None),), np.reshape(data, (1,))
    starts = [sl.indices(n)[0] if isinstance(sl, slice) else int(sl) for sl, n in zip(index, shape)]
    stops = [sl.indices(n)[1] if isinstance(sl, slice) else int(sl) + 1 for sl, n in zip(index, shape)]
    words, per = _as_words(data)
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
    w_row = _weights(rows, _ROW_SALT)
    w_col = _weights(cols, _COL_SALT)
    total = 0
    step = max(1, _BLOCK_ELEMENTS // cols.size)
    with np.errstate(over="ignore"):
        for i in range(0, rows.size, step):
            blk = words[i:i + step].astype(np.uint64)
            blk ^= w_col
            blk *= w_col
            per_row = blk.sum(axis=1, dtype=np.uint64) * w_row[i:i + step]
            total += int(per_row.sum(dtype=np.uint64))
    return total & _MASK


def _local_sum(x: jax.Array) -> int:
    if is_prng_key(x.dtype):
        x = jax.random.key_data(x)
    total = 0
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        total += _shard_sum(np.asarray(shard.data), shard.index, tuple(x.shape))
    return total & _MASK


def checksums(arrays: Sequence[jax.Array]) -> list[str]:
    """Checksums (hex strings) of global arrays; collective over processes."""
    local = [_local_sum(x) for x in arrays]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        halves = np.array([[v >> 32, v & 0xFFFFFFFF] for v in local], dtype=np.uint32)
        gathered = np.asarray(multihost_utils.process_allgather(halves))
        local = [
            sum((int(p[i, 0]) << 32) | int(p[i, 1]) for p in gathered) & _MASK
            for i in range(len(local))
        ]
    return [f"{v:016x}" for v in local]
