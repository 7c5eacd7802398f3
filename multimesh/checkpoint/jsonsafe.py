"""Turning caller-supplied metadata into something JSON can store."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def to_json_safe(x: Any, *, what: str = "metadata") -> Any:
    """Returns a JSON-serialisable copy of ``x``.

    Rules: ``None``/bool/int/str stay; finite floats stay, NaN/inf become the
    strings ``"nan"``/``"inf"``/``"-inf"``; numpy/JAX scalars become Python
    scalars and arrays nested lists (a typed PRNG key its key data, the raw
    ``uint32`` words of `jax.random.key_data`); mappings become dicts with
    ``str`` keys; named tuples and dataclasses become dicts of their fields;
    other sequences and sets become lists; a ``PartitionSpec`` becomes the list
    of its entries, a ``Mesh`` ``{"axis_names": [...], "shape": [...]}``, a
    ``NamedSharding`` ``{"mesh": ..., "spec": [...]}``; enums their name, paths
    and anything else their ``str``/``repr``.

    Raises:
      ValueError: a container holds itself (``what`` and the path name where),
        or an array was deleted (donated to a step).
    """
    return _safe(x, what, set())


def _safe(x: Any, path: str, open_containers: set[int]) -> Any:
    """`to_json_safe` of ``x`` at ``path``; ``open_containers``: ids of the containers being converted."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, jax.Array):
        if x.is_deleted():
            raise ValueError(f"{path} is a jax.Array that has been deleted (donated to a step, or deleted): "
                             f"store the value before the step that donates it, or a host copy (np.asarray)")
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return _safe(np.asarray(x).tolist(), path, open_containers)
    if isinstance(x, (np.generic, np.ndarray)):
        return _safe(np.asarray(x).tolist(), path, open_containers)
    if isinstance(x, PartitionSpec):
        return [_safe(e, path, open_containers) for e in x]
    if isinstance(x, Mesh):
        return {"axis_names": list(x.axis_names), "shape": [int(s) for s in x.devices.shape]}
    if isinstance(x, NamedSharding):
        return {"mesh": _safe(x.mesh, path, open_containers), "spec": _safe(x.spec, path, open_containers)}
    if isinstance(x, enum.Enum):
        return x.name
    items = _items(x)
    if items is None:
        if isinstance(x, os.PathLike):
            return os.fspath(x)
        if isinstance(x, type) or callable(x):
            return f"{getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', repr(x))}"
        return repr(x)
    if id(x) in open_containers:
        raise ValueError(f"{path} contains itself ({type(x).__name__} {id(x):#x} holds a reference to itself); "
                         f"JSON cannot store a cycle: pass a copy without the self-reference")
    open_containers.add(id(x))
    try:
        if isinstance(items, dict):
            return {k: _safe(v, f"{path}[{k!r}]", open_containers) for k, v in items.items()}
        out = [_safe(v, f"{path}[{i}]", open_containers) for i, v in enumerate(items)]
        if isinstance(x, (set, frozenset)):
            try:
                return sorted(out)
            except TypeError:
                return sorted(out, key=repr)
        return out
    finally:
        open_containers.discard(id(x))


def _items(x: Any) -> dict[str, Any] | list | None:
    """A container's entries: a dict with ``str`` keys (mappings, named tuples, dataclasses) or a list
    (sequences, sets); None for anything else."""
    if isinstance(x, Mapping):
        return {_key(k): v for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_asdict"):
        return dict(x._asdict())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple, set, frozenset)):
        return list(x)
    return None


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, enum.Enum):
        return k.name
    return str(k)
