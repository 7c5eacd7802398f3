"""Mesh axes that the standard rules leave unused: a misspelt ``layout.mesh`` (``{dta: 8}``) makes
``standard_rules`` empty, and every array, the batch included, is then held whole by every device of the
axis, with no error. The trainer warns, naming the axis (issue 23, item 5)."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from trainers.errors import ConfigWarning

__all__ = ["STANDARD_AXES", "unused_axis_notes", "warn_unused_axes"]

#: The mesh axes ``multimesh.jax.standard_rules`` maps logical names to.
STANDARD_AXES = ("data", "fsdp", "expert", "tensor", "model", "stage")


def _axes_used(rules: Iterable[tuple[str, Any]]) -> set[str]:
    used: set[str] = set()
    for _, axes in rules:
        if axes is not None:
            used.update([axes] if isinstance(axes, str) else axes)
    return used


def unused_axis_notes(mesh: Mapping[str, int], rules: Iterable[tuple[str, Any]]) -> list[str]:
    """One note per axis of ``mesh`` longer than 1 that no rule of the standard set ``rules`` uses."""
    used = _axes_used(rules)
    notes = []
    for axis, size in mesh.items():
        if size == 1 or axis in used:
            continue
        close = [] if axis in STANDARD_AXES else difflib.get_close_matches(axis, STANDARD_AXES, n=1)
        hint = f"Did you mean {close[0]!r}? " if close else ""
        notes.append(
            f"layout.mesh axis {axis!r} (size {size}) is used by no rule of layout.rules=standard, so nothing is "
            f"split over it: its {size} devices each hold and compute the same, batch included. {hint}The standard "
            f"rules use the axes {', '.join(STANDARD_AXES)} (tensor before model); rename the axis, or give "
            f"layout.rules that use it")
    return notes


def warn_unused_axes(mesh: Mapping[str, int], rules: Iterable[tuple[str, Any]]) -> None:
    for note in unused_axis_notes(mesh, rules):
        warnings.warn(note, ConfigWarning, stacklevel=3)
