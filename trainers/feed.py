"""Batches as a parallel step's input, in one process or several.

One process passes the global batch as host arrays (``parallelize`` places
them). With several processes (``jax.distributed``), each process reads only
the rows of the global batch that its own devices hold under the step's batch
sharding (half the rows each for a batch split over two processes' devices,
all of them for a replicated batch) and the global array is assembled with
``jax.make_array_from_process_local_data``. Every batch is a pure function of
the step, so the data position is the same on every process.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from trainers.data import TextDataset

__all__ = ["Feed", "process_rows"]


def process_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The rows ``[start, stop)`` of an array of ``shape`` that this process's devices hold (None: no
    device of this process holds any, e.g. the batch of a pipeline whose first stage is elsewhere)."""
    index = sharding.addressable_devices_indices_map(shape).values()
    if not index:
        return None
    ranges = sorted({(rows.start or 0, shape[0] if rows.stop is None else rows.stop) for rows, *_ in index})
    covered = ranges[0][0]
    for lo, hi in ranges:
        if lo > covered:
            raise ValueError(f"this process's devices hold rows that are not contiguous ({ranges}) under "
                             f"{sharding}; order the mesh's devices by process")
        covered = max(covered, hi)
    return ranges[0][0], covered


class Feed:
    """The batches of ``dataset`` as the input of ``fun`` (a function built by ``parallelize``)."""

    def __init__(self, dataset: TextDataset, fun: Any):
        self.dataset = dataset
        self.shape = (dataset.batch_size, dataset.seq_len + 1)
        self.sharding = fun.batch_shardings["tokens"] if jax.process_count() > 1 else None
        self.rows = (0, self.shape[0]) if self.sharding is None else process_rows(self.sharding, self.shape)

    def at(self, step: int) -> dict[str, Any]:
        """The global batch of ``step``, without moving the dataset's position."""
        if self.sharding is None:
            return self.dataset.batch_at(step)
        if self.rows is None:  # held by other processes' devices: a placeholder here
            return {"tokens": jax.make_array_from_single_device_arrays(self.shape, self.sharding, [], dtype=np.int32)}
        rows = self.dataset.rows_at(step, *self.rows)["tokens"]
        return {"tokens": jax.make_array_from_process_local_data(self.sharding, np.asarray(rows), self.shape)}

    def __next__(self) -> dict[str, Any]:
        """The batch at the dataset's position, which then advances."""
        batch = self.at(self.dataset.step)
        self.dataset.step += 1
        return batch

    def __iter__(self) -> Feed:
        return self

    def __repr__(self) -> str:
        where = "host arrays" if self.sharding is None else f"global arrays on {self.sharding}"
        return f"Feed({self.shape[0]} x {self.shape[1]} tokens as {where})"
