"""Warnings about layouts that are valid but are probably not what was meant."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..core.layout import Layout
from ..core.placement import Placement

__all__ = ["warn_everything_replicated", "warn_replicated_batch"]

_PREFERRED = ("data", "batch", "fsdp")  # the axes a batch usually goes over, in the order to suggest them


def _shard_axis(placement: Placement, size: int) -> str | None:
    """The mesh axis to suggest for a batch dimension of ``size``: one that divides it and that no rule
    given uses (an axis the rules give the model, as tensor parallelism's, is not for the batch);
    a data-like one first."""
    sizes, taken = placement.axis_sizes, placement.own_rules.mesh_axes
    fitting = [a for a in sizes if sizes[a] > 1 and size % sizes[a] == 0 and a not in taken]
    return next((a for a in _PREFERRED if a in fitting), fitting[0] if fitting else None)


def warn_replicated_batch(layout: Layout, placement_for: Callable[[int], Placement], *, stacklevel: int = 2) -> None:
    """Warn when batch leaves laid out by the default spec are replicated only because the rules given have
    no rule for its logical name, although a mesh axis that no rule uses could shard them (a data axis);
    name the leaves and the rule.

    Silent without rules (everything is replicated then, and `parallelize` says so), for a name that a
    rule maps to None (replicated on purpose), and for leaves a constraint in the step lays out.
    """
    missing: dict[tuple[str, str, str], list[str]] = {}
    for i, leaf in enumerate(layout.leaves):
        if leaf.source != "default" or not leaf.logical:
            continue
        placement = placement_for(i)
        if not placement.own_rules:
            continue
        for d, name in enumerate(leaf.logical):
            if not isinstance(name, str) or name in placement.rules.logical_names or leaf.spec[d] is not None:
                continue
            axis = _shard_axis(placement, leaf.shape[d])
            if axis is not None:
                missing.setdefault((name, axis, placement.describe()), []).append(leaf.path or "the batch")
    for (name, axis, where), paths in missing.items():
        shown = ", ".join(repr(p) for p in paths[:8]) + (f", ... ({len(paths)} in all)" if len(paths) > 8 else "")
        warnings.warn(
            f"parallelize: the rules have no rule for the batch's logical name {name!r}, so batch leaves {shown} "
            f"are replicated on {where} (every device gets the whole batch); add the rule ({name!r}, {axis!r}) to "
            f"shard them over {axis!r}, or ({name!r}, None) to keep them replicated",
            stacklevel=stacklevel + 1,
        )


def warn_everything_replicated(params: Layout, batch: Layout, mesh: Any, *, stacklevel: int = 2) -> None:
    """Without rules, warn when no parameter is sharded: say whether the batch is replicated too (a mesh with
    no axis named ``batch``), and the rule that splits it over the mesh's own axis."""
    if not params.leaves or any(any(leaf.spec) for leaf in params.leaves):
        return
    if any(any(leaf.spec) for leaf in batch.leaves):
        message = (f"parallelize: no rules= and no annotation names a mesh axis, so every parameter is replicated "
                   f"on all {mesh.size} devices; pass rules=[(logical_name, mesh_axis), ...] to shard")
    else:
        axis = next((a for a, n in mesh.shape.items() if n > 1), next(iter(mesh.shape)))
        message = (f"parallelize: no rules= and no annotation names a mesh axis, so every parameter and the batch "
                   f"are replicated on all {mesh.size} devices: each computes the whole step. Pass rules=[('batch', "
                   f"{axis!r})] to split the batch over {axis!r} (data parallelism), and rules for your parameters' "
                   f"logical names to shard them")
    warnings.warn(message, stacklevel=stacklevel + 1)
