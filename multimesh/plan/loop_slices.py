"""Tasks whose submesh depends on the microbatch (``Task(loop_dependent_mesh_slice=...)``).

`microbatch` traces its body once for every microbatch, so such a task is
traced once, on one slice of the global mesh. Before partitioning, each
microbatch's copy of it is moved onto that microbatch's slice
(`place_per_microbatch`): an explicit task's equation gets the iteration's
placement, and any mesh the trace wrote into an equation (a resolved
sharding constraint, a `shard_map`'s mesh) is swapped for the iteration's
slice, which has the same shape (`Task` checks it).

Such a task is not a pipeline stage: its submesh changes from one
microbatch to the next, while a stage is a device group that a schedule
orders. Its units are microbatch work outside the stages (`floating`),
run like a microbatch's glue: a forward just before the stage that reads
it, a backward just after the stage that feeds it (`order`). Embeddings
load-balanced over the stages (microbatch ``i`` on stage ``i % S``) are the
use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend.core import Jaxpr, JaxprEqn
from jax.sharding import Mesh, NamedSharding

from ..trace.implicit import microbatch_of
from ..trace.task import Placement, task_call_p
from ..trace.taskspec import loop_slices

__all__ = ["floating", "place_per_microbatch", "retarget"]


def retarget(eqn: JaxprEqn, old: Mesh, new: Mesh) -> JaxprEqn:
    """``eqn`` with every use of mesh ``old`` in its parameters (nested jaxprs too) replaced by ``new``."""
    if old == new:
        return eqn

    def swap(value: Any) -> Any:
        if isinstance(value, NamedSharding) and value.mesh == old:
            return NamedSharding(new, value.spec, memory_kind=value.memory_kind)
        if isinstance(value, Mesh) and value == old:
            return new
        if isinstance(value, Jaxpr):
            return value.replace(eqns=[retarget(e, old, new) for e in value.eqns])
        if type(value) in (tuple, list):
            return type(value)(swap(v) for v in value)
        return value

    return eqn.replace(params={k: swap(v) for k, v in eqn.params.items()})


def place_per_microbatch(eqns: Sequence[JaxprEqn], implicit: Sequence[Placement | None]) -> list[JaxprEqn]:
    """Each microbatch's copy of a loop-dependent task, on that microbatch's slice.

    ``implicit``: each equation's implicit placement (by its scope stack, which
    already names the microbatch's slice); the trace resolved those equations
    on the task's slice outside any iteration.
    """
    out = []
    families = {where: loop_slices(where) for where in set(implicit) if where is not None}
    for e, where in zip(eqns, implicit):
        if e.primitive is task_call_p and (family := loop_slices(e.params["placement"])) is not None:
            traced = e.params["placement"]
            here = family.at(microbatch_of(e.source_info.name_stack))
            e = retarget(e, traced.mesh, here.mesh)
            if here != traced:
                e = e.replace(params={**e.params, "placement": here})
        elif where is not None and (family := families[where]) is not None:
            e = retarget(e, family.at(None).mesh, where.mesh)
        out.append(e)
    return out


def floating(eqns: Sequence[JaxprEqn], colour: Sequence[Placement | None]) -> set[Placement]:
    """The placements of loop-dependent tasks whose slice differs between the step's microbatches: not stages."""
    microbatches = {microbatch_of(e.source_info.name_stack) for e in eqns} - {None}
    out: set[Placement] = set()
    for p in {p for p in colour if p is not None}:
        family = loop_slices(p)
        if family is not None and len({family.at(m) for m in microbatches}) > 1:
            out.add(p)
    return out
