"""Why a layout cannot serve a step, found before compiling it (None: no reason).

Checks, cheapest first: `batch_misfit` reads only the batch's shapes (no
trace); `idle_by_names` and `fsdp_as_data` the names the step's arrays had
on a layout built before (they are the same on every layout); `idle_axis`
the layouts of a built but not compiled step. A layout that fails them would
run, but with devices holding the same rows or the same shards as their
neighbours (or as another layout): not a layout worth compiling.
`idle_rules`: a rule set whose extra rules name nothing of the step builds
the standard layout again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from ..core.meshes import spec_names
from ..core.rules import Rules, as_axes, standard_rules
from ..run.rule_coverage import constraint_names
from .layouts import STAGE_AXIS, ParallelLayout

__all__ = ["LeafNames", "batch_misfit", "expert_misfit", "fsdp_as_data", "idle_axis", "idle_by_names", "idle_rules",
           "pipeline_misfit", "shapes_of"]

#: The axes `standard_rules` splits the batch over, in order.
_BATCH_AXES = ("data", "fsdp", "expert")


def batch_misfit(layout: ParallelLayout, batch_shapes: Sequence[tuple[int, ...]]) -> str | None:
    """Whether the batch's leading dimension splits into the layout's microbatches, each over its batch axes."""
    rows = {s[0] for s in batch_shapes if len(s) > 0}
    if not rows:
        return None
    ways = math.prod(layout.mesh.get(a, 1) for a in _BATCH_AXES)
    for n in sorted(rows):
        per = n
        if layout.microbatches:
            if n % layout.microbatches:
                return (f"{layout.microbatches} microbatches do not divide the batch's leading dimension {n}")
            per = n // layout.microbatches
        if per % ways:
            where = "a microbatch's" if layout.microbatches else "the batch's leading dimension"
            over = "data x fsdp x expert" if layout.mesh.get("expert", 1) > 1 else "data x fsdp"
            return (f"{where} {per} rows do not split over {over} = {ways} devices "
                    f"(they would hold the same rows)")
    return None


def expert_misfit(layout: ParallelLayout, experts: frozenset[int]) -> str | None:
    """An ``expert`` axis of size > 1 that does not divide the model's experts (``experts``: the sizes of its
    parameters' ``expert`` dimensions; each device of the axis holds as many experts as the others), or that
    would split only the batch of a model without experts."""
    ways = layout.mesh.get("expert", 1)
    if ways == 1:
        return None
    if not experts:
        return (f"mesh axis expert={ways}: no parameter has an 'expert' dimension (the model has no experts), so "
                f"it would split only the batch, as data does")
    undivided = sorted(n for n in experts if n % ways)
    if undivided:
        return (f"expert={ways} does not divide the model's {undivided[0]} experts (each device of the axis holds "
                f"as many experts as the others)")
    return None


@dataclasses.dataclass(frozen=True)
class LeafNames:
    """What a step's parameters and batch call their dimensions, the same on every layout: ``logical`` names
    (for the rules to map) and mesh ``axes`` named directly (a PartitionSpec of the model's own or of
    ``param_rules``); ``params_named``: whether any parameter names a dimension at all; ``params_logical``:
    the parameters' logical names alone."""

    logical: frozenset[str]
    axes: frozenset[str]
    params_named: bool
    params_logical: frozenset[str]

    @classmethod
    def of(cls, step_fn: Any) -> LeafNames:
        logical: set[str] = set()
        axes: set[str] = set()
        for leaf in (*step_fn.param_layout.leaves, *step_fn.batch_layout.leaves):
            (axes if isinstance(leaf.logical, PartitionSpec) else logical).update(spec_names(leaf.logical))
        params = step_fn.param_layout.leaves
        return cls(frozenset(logical), frozenset(axes), any(spec_names(leaf.logical) for leaf in params),
                   frozenset(n for leaf in params if not isinstance(leaf.logical, PartitionSpec)
                             for n in spec_names(leaf.logical)))


def idle_axis(layout: ParallelLayout, step_fn: Any, rules: Rules, names: LeafNames) -> str | None:
    """A mesh axis of size > 1 that shards no parameter and no batch array of the step built with ``rules``
    (``names``: `LeafNames.of` the step, for the reason)."""
    used: set[str] = set()
    for leaf in (*step_fn.param_layout.leaves, *step_fn.batch_layout.leaves):
        used |= spec_names(leaf.spec)
    for axis, size in layout.mesh.items():
        if size > 1 and axis != STAGE_AXIS and axis not in used:
            return _idle(layout, axis, size, names, rules)
    return None


def idle_by_names(layout: ParallelLayout, names: LeafNames, rules: Rules) -> str | None:
    """`idle_axis` before building: a mesh axis of size > 1 that nothing the step holds can be sharded over,
    whatever the mesh, because no array names it and ``rules`` map it no logical name that an array has
    (``names``: read from the step built on another layout)."""
    for axis, size in layout.mesh.items():
        if size > 1 and axis != STAGE_AXIS and axis not in names.axes | names.logical \
                and not names.logical & _names_given(rules, axis):
            return _idle(layout, axis, size, names, rules)
    return None


def fsdp_as_data(layout: ParallelLayout, names: LeafNames, rules: Rules, axes: Sequence[str]) -> str | None:
    """A layout whose ``fsdp`` axis, like ``data``, splits only the batch (``rules`` give neither a name any
    parameter has, and no parameter names either): the same layout as the one with both merged into
    ``data``, which the search over ``axes`` tries too."""
    fsdp = layout.mesh.get("fsdp", 1)
    if fsdp == 1 or "data" not in axes:
        return None
    for axis in ("data", "fsdp"):  # named by a parameter itself (a PartitionSpec, NNX metadata) or by a rule
        if axis in names.axes | names.params_logical or names.params_logical & _names_given(rules, axis):
            return None
    merged = {"data": layout.mesh.get("data", 1) * fsdp, **{a: n for a, n in layout.mesh.items() if a not in
                                                             ("data", "fsdp")}}
    return (f"fsdp={fsdp} splits only the batch, as data does (no parameter is sharded over data or fsdp): the "
            f"same layout as {dataclasses.replace(layout, mesh=merged).describe()}")


def _idle(layout: ParallelLayout, axis: str, size: int, names: LeafNames, rules: Rules) -> str:
    """Why mesh ``axis`` shards nothing, in words."""
    unruled = sorted(names.params_logical - rules.logical_names - rules.generic - set(layout.whole_mesh))
    if not names.params_named:
        why = ("no parameter has logical axis names for the rules to map (such as 'embed', 'mlp'): name "
               "them with param_rules= or Flax metadata (nn.with_logical_partitioning)")
    elif unruled:
        why = (f"no rule maps the model's own logical names {', '.join(map(repr, unruled))} to an axis: "
               f"give them rules=, e.g. rules=[({unruled[0]!r}, {axis!r})]")
    elif not names.params_logical & (given := _names_given(rules, axis)):
        why = f"its rules give it {', '.join(map(repr, sorted(given))) or 'no name'}, which no parameter has"
    else:
        why = f"no dimension its rules name is divisible by {size}"
    return (f"mesh axis {axis}={size} shards no parameter or batch array ({why}), so its {size} devices would hold "
            f"the same")


def _names_given(rules: Rules, axis: str) -> set[str]:
    """The logical names ``rules`` map to mesh ``axis``."""
    return {name for name, named in rules if axis in as_axes(named)}


def idle_rules(layout: ParallelLayout, step_fn: Any) -> str | None:
    """A rule set other than the standard one whose extra rules name nothing the built step holds or
    constrains (e.g. the ``sequence`` rules for a step with no ``length`` dimension): the same layout as
    the standard rules'."""
    if layout.rules == "standard":
        return None
    axes = tuple(layout.whole_mesh)
    extra = layout.rule_set().logical_names - standard_rules(axes).logical_names
    named: set[str] = set()
    for leaf in (*step_fn.param_layout.leaves, *step_fn.batch_layout.leaves):
        named |= spec_names(leaf.logical)
    if step_fn.plan is not None:
        own, hinted = constraint_names(step_fn.plan.step_jaxpr or step_fn.plan.jaxpr)
        named |= own | hinted
    if extra & named:
        return None
    listed = ", ".join(repr(n) for n in sorted(extra))
    return (f"the {layout.rules} rules are the standard rules here: nothing the step holds or constrains is "
            f"named {listed}")


def pipeline_misfit(layout: ParallelLayout, step_fn: Any) -> str | None:
    """Whether a pipeline layout built as one: its stages registered and its microbatches scheduled."""
    if not layout.is_pipeline:
        return None
    schedule = getattr(step_fn.plan, "schedule", None) if step_fn.plan is not None else None
    if schedule is None:
        return ("no pipeline schedule was built: the pipeline= context registered no stage the step runs, or the "
                "step calls no microbatch(...) (its loss must be microbatched for a pipeline)")
    if schedule.num_stages != layout.stages or schedule.num_microbatches != layout.microbatches:
        return (f"the step built {schedule.num_stages} stages x {schedule.num_microbatches} microbatches, not "
                f"{layout.stages} x {layout.microbatches}: does pipeline=(stages, chunks) register that many stages?")
    return None


def shapes_of(abstract: Any) -> list[tuple[int, ...]]:
    """The shapes of a pytree's leaves."""
    import jax

    return [tuple(np.shape(x)) for x in jax.tree.leaves(abstract)]
