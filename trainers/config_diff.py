"""Which keys of two configs differ, named as the overrides that set them (``model.d_model``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import yaml

__all__ = ["changed_keys", "describe_changes", "yaml_value"]


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    """Dotted key -> leaf value of a dataclass or mapping (nested mappings flattened)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_flat(item, f"{prefix}.{key}"))
    return out


def changed_keys(old: Any, new: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for each key of ``old`` and ``new`` (config sections:
    dataclasses or mappings) whose values differ, in key order; a key only one has gives ``None`` on
    the other side."""
    a, b = _flat(old, prefix), _flat(new, prefix)
    return [(key, a.get(key), b.get(key)) for key in dict.fromkeys([*a, *b]) if a.get(key) != b.get(key)]


def yaml_value(value: Any) -> str:
    """``value`` as it is written in an override (``false``, ``null``, ``[a, b]``)."""
    text = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """``"model.tie_embeddings: false -> true, model.d_model: 128 -> 64"``."""
    return ", ".join(f"{key}: {yaml_value(a)} -> {yaml_value(b)}" for key, a, b in changes)
