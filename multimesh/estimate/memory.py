"""Whether a step's state fits the memory it will live in: a check before anything is compiled.

The state a step is given (parameters and optimizer state, each leaf laid out by its sharding) is
exact from its shapes, needs no compile, and must all be in memory at once: it is a lower bound of
the step's peak, so a state over the memory cannot run whatever XLA does with its temporaries, and
would otherwise fail minutes later (in the compiler, or at the first allocation). What "the memory"
is depends on the devices: one that reports its own limit (a GPU's or TPU's ``bytes_limit``) holds
its shards alone; host devices (CPU) share the host's memory, which is what the system has
available now, under this process's cgroup limit where there is one. ``MULTIMESH_MEMORY_LIMIT``
(bytes, or with a unit: ``10GiB``) overrides either: per device where devices have their own
memory, for the host's devices together otherwise.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..core.fmt import format_bytes
from .held import slice_bytes

__all__ = ["LIMIT_VARIABLE", "MemoryLimit", "StateDoesNotFitError", "check_state_fits", "memory_limit", "state_bytes"]

LIMIT_VARIABLE = "MULTIMESH_MEMORY_LIMIT"
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


class StateDoesNotFitError(ValueError):
    """A step's state is larger than the memory of the devices it is laid out on.

    Attributes: ``need`` (bytes of state in the fullest memory), ``have`` (that memory's bytes),
    ``total`` (the whole state's bytes), ``limit`` (the `MemoryLimit`) and ``at_least`` (how many such
    memories, the state sharded evenly over all of them, would hold it).
    """

    def __init__(self, message: str, *, need: int, have: int, total: int, limit: MemoryLimit):
        super().__init__(message)
        self.need, self.have, self.total, self.limit = need, have, total, limit
        self.at_least = max(2, math.ceil(total / max(have, 1)))


@dataclass(frozen=True)
class MemoryLimit:
    """The bytes a memory holds: each device's own (``per_device``), or the host's for this process's
    devices together; ``source`` says where the figure comes from."""

    bytes: int
    per_device: bool
    source: str

    def describe(self) -> str:
        return f"{format_bytes(self.bytes)} ({self.source})"


def parse_bytes(text: str) -> int:
    """``"10GiB"``, ``"512 MB"``, ``"1073741824"`` as bytes; a `ValueError` naming the variable otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    size = 0 if m is None or m.group(2).lower() not in _UNITS else int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size < 1:  # nothing, or less than one byte once the unit is applied ("0.5 B")
        raise ValueError(f"{LIMIT_VARIABLE}={text!r}: give the memory in bytes (at least 1), or with a unit "
                         f"(10GiB, 512MB)")
    return size


def memory_limit(devices: Sequence[Any] | None = None) -> MemoryLimit:
    """The memory this process's ``devices`` (default: its local devices) hold: see the module's text."""
    local = [d for d in (devices or jax.local_devices()) if d.process_index == jax.process_index()]
    own = _own_limit(local[0]) if local else None
    override = os.environ.get(LIMIT_VARIABLE)
    if override:
        return MemoryLimit(parse_bytes(override), own is not None, f"${LIMIT_VARIABLE}")
    if own is not None:
        return MemoryLimit(own, True, f"{local[0].device_kind} memory")
    return _host_available()


def _own_limit(device: Any) -> int | None:
    try:
        stats = device.memory_stats() if device.platform != "cpu" else None
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def _host_available() -> MemoryLimit:
    """What the host has available now (``MemAvailable``), or less where this process's cgroup allows less."""
    available, source = _meminfo_available(), "available on this host"
    if available is None:
        available, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's memory"
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, used = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and limit < 2**60:  # "max" (v2) or a huge number (v1) means none
            left = max(0, limit - (used or 0))
            if left < available:
                available, source = left, f"left under the cgroup memory limit of {format_bytes(limit)}"
            break
    return MemoryLimit(int(available), False, source)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def state_bytes(abstract_state: Any) -> dict[int, int]:
    """Device id -> bytes of the shards ``abstract_state`` (``jax.ShapeDtypeStruct``s or arrays with
    shardings) puts there; leaves without a sharding are not counted."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(abstract_state):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not hasattr(leaf, "shape"):
            continue
        for d, n in slice_bytes(tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, sharding).items():
            out[d] = out.get(d, 0) + n
    return out


def check_state_fits(abstract_state: Any, *, what: str = "the state", limit: MemoryLimit | None = None) -> None:
    """Raise `StateDoesNotFitError` when ``abstract_state``'s shards on this process's devices exceed
    their memory (`memory_limit`, or ``limit``): per device where each has its own, else all of this
    process's shards against the host's. Reads only shapes and shardings."""
    held = state_bytes(abstract_state)
    if not held:
        return
    total = _whole_state_bytes(abstract_state)
    mine = {d.id for d in jax.local_devices()}
    local = {d: n for d, n in held.items() if d in mine}
    if not local:
        return
    limit = limit or memory_limit()
    if limit.per_device:
        device, need = max(local.items(), key=lambda kv: kv[1])
        where = f"device {device} holds {format_bytes(need)} of it"
    else:
        need = sum(local.values())
        where = (f"this host's {len(local)} device(s) hold {format_bytes(need)} of it together (host devices "
                 f"share the host's memory)")
    if need <= limit.bytes:
        return
    raise StateDoesNotFitError(
        f"{what} does not fit: {where}, before any activation or temporary, but "
        f"{'each device holds' if limit.per_device else 'the host has'} {limit.describe()}: "
        f"{format_bytes(need - limit.bytes)} short",
        need=need, have=limit.bytes, total=total, limit=limit)


def _whole_state_bytes(abstract_state: Any) -> int:
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(abstract_state)
               if hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
