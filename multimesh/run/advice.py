"""Warnings about layouts that are valid but are probably not what was meant."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ..core.layout import Layout
from ..core.placement import Placement

__all__ = ["mesh_axes_of", "warn_everything_replicated", "warn_replicated_batch"]

_PREFERRED = ("data", "batch", "fsdp")  # the axes a batch usually goes over, in the order to suggest them


def _shard_axis(placement: Placement, size: int, model_axes: Collection[str] = ()) -> str | None:
    """The mesh axis to suggest for a batch dimension of ``size``: one that divides it and that no rule
    given uses (an axis the rules give the model, as tensor parallelism's, is not for the batch), nor the
    model's own parameters unless it is data-like (FSDP's); a data-like one first."""
    sizes = placement.axis_sizes
    taken = set(placement.own_rules.mesh_axes) | (set(model_axes) - set(_PREFERRED))
    fitting = [a for a in sizes if sizes[a] > 1 and size % sizes[a] == 0 and a not in taken]
    return next((a for a in _PREFERRED if a in fitting), fitting[0] if fitting else None)


def mesh_axes_of(layout: Layout) -> tuple[str, ...]:
    """The mesh axes a layout's arrays are sharded over, in order of first use."""
    axes: dict[str, None] = {}
    for leaf in layout.leaves:
        for entry in leaf.spec:
            axes.update(dict.fromkeys(entry if isinstance(entry, tuple) else () if entry is None else (entry,)))
    return tuple(axes)


def warn_replicated_batch(layout: Layout, placement_for: Callable[[int], Placement], *,
                          model_axes: Sequence[str] = (), main: Placement | None = None, stacklevel: int = 2) -> None:
    """Warn when batch leaves laid out by the default spec are replicated only because no rule names their
    logical name, although a mesh axis that no rule uses could shard them (a data axis); name the leaves and
    the rule.

    ``model_axes``: the mesh axes the parameters are sharded over. Without rules, silent when that is none
    (everything is replicated then, and `parallelize` says so); when the model shards its own parameters
    (mesh axes in its metadata), it says so. Silent for a name that a rule maps to None (replicated on
    purpose), and for leaves a constraint in the step lays out. ``main``: the step's placement (a leaf on
    another is on a task's, whose rules its registration gives).
    """
    missing: dict[tuple[str, str, str, bool, bool], list[str]] = {}
    for i, leaf in enumerate(layout.leaves):
        if leaf.source != "default" or not leaf.logical:
            continue
        placement = placement_for(i)
        if not placement.own_rules and not model_axes:
            continue
        for d, name in enumerate(leaf.logical):
            if not isinstance(name, str) or name in placement.rules.logical_names or leaf.spec[d] is not None:
                continue
            axis = _shard_axis(placement, leaf.shape[d], model_axes)
            if axis is not None:
                key = (name, axis, placement.describe(), bool(placement.own_rules), placement is not main)
                missing.setdefault(key, []).append(leaf.path or "the batch")
    for (name, axis, where, with_rules, on_task), paths in missing.items():
        shown = ", ".join(repr(p) for p in paths[:8]) + (f", ... ({len(paths)} in all)" if len(paths) > 8 else "")
        if with_rules:
            why = f"the rules have no rule for the batch's logical name {name!r}"
            fix = f"add the rule ({name!r}, {axis!r})"
        else:
            over = ", ".join(repr(a) for a in model_axes)
            why = (f"the model shards its own parameters (over {over}) and no rule names the batch's logical "
                   f"name {name!r}")
            fix = (f"give the task's register_task logical_axes=[({name!r}, {axis!r})]" if on_task and main else
                   f"pass rules=[({name!r}, {axis!r})]")
        warnings.warn(
            f"parallelize: {why}, so batch leaves {shown} are replicated on {where} (every device gets the whole "
            f"batch); {fix} to shard them over {axis!r}, or ({name!r}, None) to keep them replicated",
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
