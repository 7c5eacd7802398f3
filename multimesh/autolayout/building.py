"""Building a step on a `ParallelLayout`: its mesh, its rules, and for a pipeline its stages and microbatches.

A pipeline's stages are slices of one mesh whose outermost axis is ``pipe``:
stage ``s`` holds the devices ``[s * n, (s + 1) * n)`` (``n`` per stage), laid
out as the layout's stage mesh. The caller's ``pipeline(stages, chunks)``
context registers the model's parts on them, typically with
``register_task(pattern, callback=lambda name, backprop: stage_task(s))``; the
number of microbatches and the schedule reach the step's `microbatch` call
through `choose_pipeline`.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ContextManager

import numpy as np
from jax.sharding import AxisType, Mesh

from ..core.meshes import context_axis_types
from ..core.rules import Rules, as_axes, standard_rules
from ..run.parallelize import parallelize_on_mesh
from ..trace.pipeline_choice import choose_pipeline
from ..trace.taskspec import Task, current_global_mesh, use_global_mesh
from .layouts import STAGE_AXIS, ParallelLayout

__all__ = ["PipelineFactory", "build_on", "layout_mesh", "layout_rules", "stage_task"]

#: ``pipeline(stages, chunks)``: a context manager under which `parallelize` builds a pipeline of that many
#: stages (each running ``chunks`` groups of layers).
PipelineFactory = Callable[[int, int], ContextManager[Any]]
#: The rules of the layout being built, for its stages (`stage_task`).
_LAYOUT_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("layout_rules", default=None)


def stage_task(stage: int, name: str | None = None) -> Task:
    """Stage ``stage`` of the layout being built: the slice ``{"pipe": stage}`` of the mesh in force, with
    the layout's rules (`standard_rules` of the mesh's axes outside a search). For a ``pipeline=`` context
    given to `auto_layout`."""
    mesh = current_global_mesh()
    if mesh is None or STAGE_AXIS not in mesh.axis_names:
        raise ValueError(f"stage_task({stage}): no mesh with a {STAGE_AXIS!r} axis is in force; call it inside the "
                         f"pipeline= context that auto_layout or parallelize(layout='auto') enters")
    stages = dict(mesh.shape)[STAGE_AXIS]
    if not 0 <= stage < stages:
        raise ValueError(f"stage_task({stage}): the layout being built has {stages} stages (0..{stages - 1})")
    rules = _LAYOUT_RULES.get() or standard_rules(mesh.axis_names)
    return Task(name=name or f"stage{stage}", mesh_slice={STAGE_AXIS: stage}, logical_axes=rules)


def layout_mesh(layout: ParallelLayout, devices: Sequence[Any], explicit_axes: frozenset[str] | None = None) -> Mesh:
    """The layout's whole mesh over the first devices, in order (stage outermost). ``explicit_axes``: the axes
    of type Explicit, the others Auto; None: the types the mesh in context (``jax.set_mesh``) gives the axes
    it names, Auto for the others (as `parallelize` builds an ``{axis: size}`` mesh)."""
    shape = layout.whole_mesh
    picked = np.empty(layout.num_devices, dtype=object)
    picked[:] = list(devices)[:layout.num_devices]
    names = tuple(shape)
    if explicit_axes is None:
        types = context_axis_types(names)
    else:
        types = tuple(AxisType.Explicit if n in explicit_axes else AxisType.Auto for n in names)
    return Mesh(picked.reshape(tuple(shape.values())), names, axis_types=types)


def layout_rules(layout: ParallelLayout, own_rules: Rules | None = None) -> Rules:
    """The layout's rule set, after ``own_rules`` (rules for the model's own logical names), each of which
    keeps the mesh axes this layout's mesh has (none: that name stays whole here)."""
    rules = layout.rule_set()
    if not own_rules:
        return rules
    axes = set(layout.whole_mesh)
    kept = [(name, tuple(a for a in as_axes(named) if a in axes) or None) for name, named in own_rules]
    return Rules(kept) + rules


@contextlib.contextmanager
def _placed(layout: ParallelLayout, rules: Rules, mesh: Mesh, pipeline: PipelineFactory | None) -> Iterator[None]:
    """The mesh in force for `stage_task`, and for a pipeline its registrations and chosen microbatches."""
    with use_global_mesh(mesh), contextlib.ExitStack() as stack:
        token = _LAYOUT_RULES.set(rules)
        stack.callback(_LAYOUT_RULES.reset, token)
        if layout.is_pipeline:
            if pipeline is None:
                raise ValueError(f"layout {layout.describe()!r} is a pipeline; building it needs pipeline= "
                                 f"(stages, chunks) -> a context that registers the model's stages")
            stack.enter_context(pipeline(layout.stages, layout.chunks))
            if layout.microbatches is None or layout.schedule is None:
                raise ValueError(f"layout {layout.describe()!r} is a pipeline; it needs microbatches= and "
                                 f"schedule= (e.g. ParallelLayout(..., microbatches=8, schedule='1f1b'))")
            stack.enter_context(choose_pipeline(layout.microbatches, layout.schedule, layout.stages,
                                                layout.chunks if layout.chunks > 1 else None))
        yield


def build_on(layout: ParallelLayout, fun: Callable, devices: Sequence[Any], pipeline: PipelineFactory | None,
             quiet: bool = False, explicit_axes: frozenset[str] | None = None, own_rules: Rules | None = None,
             **kwargs: Any) -> Any:
    """``parallelize(fun, **kwargs)`` on ``layout`` (what `parallelize` returns), ``explicit_axes`` as for
    `layout_mesh`, ``own_rules`` as for `layout_rules`. ``quiet``: without its warnings (a search judges
    layouts by its own checks)."""
    mesh = layout_mesh(layout, devices, explicit_axes)
    rules = layout_rules(layout, own_rules)
    with _placed(layout, rules, mesh, pipeline), warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        return parallelize_on_mesh(fun, mesh=mesh, rules=rules, **kwargs)
