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


def to_json_safe(x: Any) -> Any:
    """Returns a JSON-serialisable copy of ``x``.

    Rules: ``None``/bool/int/str stay; finite floats stay, NaN/inf become the
    strings ``"nan"``/``"inf"``/``"-inf"``; numpy/JAX scalars become Python
    scalars and arrays nested lists; mappings become dicts with ``str`` keys;
    named tuples and dataclasses become dicts of their fields; other sequences
    and sets become lists; a ``PartitionSpec`` becomes the list of its entries, a
    ``Mesh`` ``{"axis_names": [...], "shape": [...]}``, a ``NamedSharding``
    ``{"mesh": ..., "spec": [...]}``; enums their name, paths and anything else
    their ``str``/``repr``.
    """
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, (np.generic, np.ndarray, jax.Array)):
        return to_json_safe(np.asarray(x).tolist())
    if isinstance(x, PartitionSpec):
        return [to_json_safe(e) for e in x]
    if isinstance(x, Mesh):
        return {"axis_names": list(x.axis_names), "shape": [int(s) for s in x.devices.shape]}
    if isinstance(x, NamedSharding):
        return {"mesh": to_json_safe(x.mesh), "spec": to_json_safe(x.spec)}
    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, Mapping):
        return {_key(k): to_json_safe(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_asdict"):
        return {k: to_json_safe(v) for k, v in x._asdict().items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: to_json_safe(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [to_json_safe(v) for v in x]
    if isinstance(x, (set, frozenset)):
        items = [to_json_safe(v) for v in x]
        try:
            return sorted(items)
        except TypeError:
            return sorted(items, key=repr)
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if isinstance(x, type) or callable(x):
        return f"{getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', repr(x))}"
    return repr(x)


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, enum.Enum):
        return k.name
    return str(k)
