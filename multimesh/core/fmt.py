"""Text formatting shared by reports, plans, checkpoints and the trainer.

Pure Python: nothing here imports JAX or touches a device.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["device_span", "format_bytes", "keypath_str"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def device_span(ids: Iterable[int], *, empty: str = "") -> str:
    """Device ids as a short string: ``"0-3"`` for a run of consecutive ascending ids, else ``"0,2,5"``.

    The ids are written in the order given (sort them first for a set of
    devices). One id is just that id; no ids give ``empty``.
    """
    ids = list(ids)
    if not ids:
        return empty
    if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def format_bytes(n: float, *, unit: str | None = None, digits: int = 1, exact_below: int = 0) -> str:
    """A byte count for people: ``"123 B"``, ``"1.5 KiB"``, ``"2.0 MiB"``.

    Args:
      n: the number of bytes.
      unit: ``None`` picks the largest of B, KiB, MiB, GiB, TiB in which the
        size is under 1024 (TiB at most); a unit name always uses that unit.
      digits: decimals of every unit but B (bytes are whole).
      exact_below: sizes under this many bytes are written as whole bytes,
        whatever ``unit`` says.

    ``format_bytes(n, unit="MiB", digits=2, exact_below=2**16)`` gives
    ``"1.23 MiB"`` from 64 KiB up and ``"123 B"`` below.
    """
    if unit is not None and unit not in _UNITS:
        raise ValueError(f"unknown unit {unit!r}; expected one of {_UNITS}")
    if n < exact_below:
        unit = "B"
    elif unit is None:
        unit = next((u for i, u in enumerate(_UNITS) if n < 1024 ** (i + 1)), _UNITS[-1])
    if unit == "B":
        return f"{int(n)} B"
    return f"{n / 1024 ** _UNITS.index(unit):.{digits}f} {unit}"


def keypath_str(keypath: Iterable[object], *, root: str = "") -> str:
    """A JAX key path as ``/``-joined names: ``(DictKey('params'), DictKey('Dense_0'))`` -> ``'params/Dense_0'``.

    Each key contributes its ``key`` (dict keys, flattened indices), ``name``
    (attributes) or ``idx`` (sequence indices), else ``str(key)``. The empty
    path (the root of the tree) gives ``root``.
    """
    parts = []
    for k in keypath:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts) or root
