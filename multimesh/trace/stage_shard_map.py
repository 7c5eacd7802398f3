"""A `shard_map` the model calls with its own mesh, run on the pipeline stage's submesh.

Model code computes parts of a layer per device with ``jax.shard_map(f,
mesh=<its mesh>, in_specs=..., out_specs=...)``: an MoE layer's experts, with
a ``psum`` over its ``expert`` axis. In a pipeline each stage runs on a
submesh, in a program JAX compiles for the submesh's devices only, and a
`shard_map` over the whole mesh cannot run there. As a sharding constraint
does, such a `shard_map` runs on the submesh of the stage that runs it: its
``in_specs`` and ``out_specs`` keep their axes, now the submesh's (a stage
that splits the mesh along ``x`` keeps ``x`` with size 1), and a collective
inside keeps its meaning on the stage's devices (a ``psum`` over ``expert``
sums over the stage's expert group). An axis the specs name that the stage
lacks is an error naming the function, the stage and the axis, unless it has
size 1 on the model's mesh of Auto axes: then splitting along it splits
nothing, and it is dropped from the specs and from the body's collectives (a
``psum`` over a size-1 axis is the identity, its ``axis_index`` 0), with a
`StageAxisDropped` warning, once per function, stage and axes. (On Explicit
axes the stage's arrays are typed by its own mesh, so the model's own
``reshard`` to such specs fails there already: keep the axis on the stage.)

Two places move it:

* while a step is traced (`routing_stage_shard_maps`, in force with any
  placement), for a `shard_map` whose stage is known then: inside a scope
  `register_task` matches (a named scope, an NNX path) on a mesh of Auto
  axes, and on the stage's abstract mesh on which a pipeline of Explicit
  axes is traced again (`run.parallelize._retrace_on_stages`), where JAX
  would refuse a mesh other than the one in context; and, for stages chosen
  by ``register_task(params=...)`` on Auto axes, in the trace again on the
  stages' one shape (`traced_on_stage`) where the first trace gave a
  `shard_map` axis sizes its stage lacks (`traced_for_other_sizes`). The
  function is traced on the stage's submesh, so its shapes are the stage's;
* where a segment's program is compiled (`onto_stage`, a rule of
  `constraints.resolve_deferred`): an equation traced on another mesh (the
  whole mesh, for stages chosen by ``register_task(params=...)``, which are
  known only once the step is traced; or another stage's) is bound on the
  submesh, its body as traced. There the axes its specs name must have the
  same sizes on both meshes (the body's shapes are per device): stages of
  two shapes cannot be traced again on one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from .._compat.jax import equation_context
from .._compat.shard_map import (
    ShardMapCall,
    set_shard_map_router,
    shard_map_call,
    shard_map_moved,
    shard_map_rebound,
)
from ..core.jaxprs import subjaxprs
from ..core.meshes import abstract_mesh_context
from ..core.placement import Placement, current_placement, while_placed
from .implicit import placement_in_scope
from .interpret import bind_equation, interpret
from .scopes import scope_stack
from .shared_hook import SharedHook

__all__ = ["StageAxisDropped", "StageAxisError", "on_another_mesh", "onto_stage", "routing_stage_shard_maps",
           "traced_for_other_sizes", "traced_on_stage"]


class StageAxisError(ValueError):
    """A `shard_map` inside a pipeline stage names a mesh axis the stage's submesh lacks (or has at another
    size where the body's shapes depend on it)."""


class StageAxisDropped(UserWarning):
    """A `shard_map` inside a pipeline stage names a mesh axis the stage's submesh lacks and that has size 1
    on the model's mesh: it is dropped from the specs and the collectives, the same computation."""


#: (function, stage, axes) already warned about by `StageAxisDropped`
_WARNED: set[tuple[str, str, tuple[str, ...]]] = set()


def _spec_axes(specs: Any) -> set[str]:
    """The mesh axes a tree of `PartitionSpec`s names."""
    leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    return {a for s in leaves if isinstance(s, PartitionSpec) for entry in s if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,)) if isinstance(a, str)}


def _what(function: Any, scope: str | None) -> str:
    name = function if isinstance(function, str) else getattr(function, "__name__", None) or "<function>"
    return f"shard_map of {name!r}" + (f" (scope {scope!r})" if scope else "")


def _check_axes(function: Any, scope: str | None, axes: set[str], given: Any, stage: Placement,
                droppable: bool = True) -> frozenset[str]:
    """Refuse an axis the specs (or ``axis_names``) name that the stage's submesh lacks, unless it has size 1
    on the mesh the call was given (``given``) and ``droppable``: those are returned, to be dropped, and warned
    about once."""
    missing = sorted(axes - set(stage.mesh.axis_names))
    if not missing:
        return frozenset()
    what = _what(function, scope)
    sizes = dict(given.shape) if given is not None and not given.empty else {}
    refused = [a for a in missing if sizes.get(a) != 1 or not droppable]
    if not refused:
        key = (_what(function, None), stage.describe(), tuple(missing))
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(StageAxisDropped(
                f"{what} names mesh ax{'is' if len(missing) == 1 else 'es'} {', '.join(map(repr, missing))} of "
                f"size 1, which the stage {stage.describe()} lacks: dropped from its in_specs/out_specs and "
                f"from its collectives (a psum over a size-1 axis is the identity), the same computation. Give "
                f"the stage's submesh the axis (size 1) to keep it"), stacklevel=2)
        return frozenset(missing)
    shown = ", ".join(f"{a!r}" + (f" (size {sizes[a]} on its own mesh)" if a in sizes else "") for a in refused)
    raise StageAxisError(
        f"{what} names mesh ax{'is' if len(refused) == 1 else 'es'} {shown} in its in_specs/out_specs, which "
        f"the stage {stage.describe()} lacks. Inside a pipeline stage a shard_map runs on the stage's submesh "
        f"with its specs unchanged (an axis of size 1 on the model's mesh is dropped, but on Explicit axes, where "
        f"the stage's arrays are typed by its mesh): give the stage's submesh "
        f"the model's axis names (where stages split the mesh along an axis, keep it with size 1: "
        f"Task(mesh_slice={{{refused[0]!r}: i}}) or a Mesh of the model's axes), or write the specs with the "
        f"stage's axes {dict(stage.mesh.shape)}")


def _with_axes(mesh: Mesh, axes: frozenset[str], given: Any) -> Mesh:
    """``mesh`` with the size-1 axes ``axes`` added last (the same devices), typed as on ``given``."""
    names = sorted(axes)
    types = dict(zip(given.axis_names, given.axis_types))
    return Mesh(np.asarray(mesh.devices).reshape(mesh.devices.shape + (1,) * len(names)),
                (*mesh.axis_names, *names), axis_types=(*mesh.axis_types, *(types[a] for a in names)))


def _target(given: Any) -> Placement | None:
    """The placement whose submesh a call given mesh ``given`` runs on while traced here; None: as given.

    JAX's context mesh, where there is one (Explicit axes), is the one the call must be on: in a pipeline's
    trace on its stages' abstract mesh, that stage's submesh; in the first trace on the whole mesh, the step's
    own mesh (a stage's submesh given there, e.g. by multimesh's `shard_map` inside a registered scope, moves
    there when its program is compiled). Without one (Auto axes) it is the submesh of the scope being traced,
    and for a call given no mesh either, else the placement's (where JAX's context mesh would be).
    """
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return None   # inside another shard_map
    placement = current_placement()
    in_scope = placement_in_scope() if placement is None or placement.defer else placement
    if context.empty:   # no mesh given either: the placement's, as JAX's context would have given it
        where = in_scope if given is not None or in_scope is not None else placement
        if where is None and given is not None:   # a pipeline of Auto axes traced again on its stages' shape
            where = _RETRACED_ON.get()
        return None if where is None or given == where.mesh else where
    if given is None or given.abstract_mesh == context:
        return None
    for candidate in (in_scope, placement):
        if candidate is not None and candidate.mesh.abstract_mesh == context:
            return candidate
    return None


def _route(given: Any, axis_names: Any, in_specs: Any, out_specs: Any, function: Callable | None) -> tuple:
    """`set_shard_map_router`'s route: the call on the submesh `_target` names, its specs checked there."""
    stage = _target(given)
    if stage is None or stage.mesh == given:
        return given, axis_names
    mesh_of_call = given if given is not None else (current_placement() or stage).mesh
    # on Explicit axes (JAX's context mesh the stage's) the call must be on the stage's own mesh
    dropped = _check_axes(function, scope_stack() or None, _spec_axes((in_specs, out_specs)), mesh_of_call, stage,
                          droppable=jax.sharding.get_abstract_mesh().empty)
    # traced on the stage's devices with the dropped size-1 axes kept (the body's collectives name them); they
    # are dropped where the segment's program is compiled on the stage's submesh (`onto_stage`)
    mesh = _with_axes(stage.mesh, dropped, mesh_of_call) if dropped else stage.mesh
    if axis_names:   # manual over those of its axes the stage has (an axis no spec names may be gone)
        axis_names = frozenset(axis_names) & set(mesh.axis_names)
    return mesh, axis_names


def on_another_mesh(eqn: Any) -> bool:
    """Whether ``eqn`` is a `shard_map` on another mesh than the submesh of the placement in force."""
    call = shard_map_call(eqn)
    placement = current_placement()
    return call is not None and placement is not None and _elsewhere(call.mesh, placement.mesh)


def _elsewhere(mesh: Any, here: Any) -> bool:
    """Whether ``mesh`` is another than ``here``: a concrete mesh another concrete mesh; an abstract mesh (or
    any mesh compared with one) of another shape, axis names or types."""
    if isinstance(mesh, Mesh) and isinstance(here, Mesh):
        return mesh != here
    return getattr(mesh, "abstract_mesh", mesh) != getattr(here, "abstract_mesh", here)


def onto_stage(eqn: Any, ins: list) -> list:
    """``eqn``, a `shard_map` on another mesh, bound on the submesh of the placement in force (see the module
    docstring): its specs and body unchanged but for size-1 axes the submesh lacks, dropped; made manual over
    the same axes that the submesh has."""
    call = shard_map_call(eqn)
    stage = current_placement()
    assert call is not None and stage is not None
    what = _what(call.function, None)
    named = _spec_axes((call.in_specs, call.out_specs))
    dropped = _check_axes(call.function, None, named, call.mesh, stage)
    _check_sizes(what, call, named - dropped, stage)
    manual = call.manual_axes & set(stage.mesh.axis_names)
    if not dropped and not _elsewhere(call.mesh, stage.mesh.abstract_mesh):   # same shape: the body's types hold
        return bind_equation(shard_map_moved(eqn, stage.mesh, manual), ins)
    specs = None if not dropped else (_without(call.in_specs, dropped), _without(call.out_specs, dropped))
    return shard_map_rebound(eqn, ins, stage.mesh, manual, functools.partial(_body_here, dropped=dropped),
                             specs=specs)


def _without(specs: tuple, axes: frozenset[str]) -> tuple:
    """Flat specs with ``axes`` left out (an entry left naming none: None, not split)."""
    def entry(e: Any) -> Any:
        kept = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 and not isinstance(e, tuple) else kept
    return tuple(s if not isinstance(s, PartitionSpec) else PartitionSpec(*(e if e is None else entry(e) for e in s))
                 for s in specs)


def _body_here(jaxpr: Any, ins: list, dropped: frozenset[str] = frozenset()) -> list:
    """A shard_map's body evaluated on the manual mesh in context (each equation in its own context but that),
    the size-1 axes ``dropped`` left out of its collectives."""
    return interpret(jaxpr, (), ins, functools.partial(_bind_here, dropped=dropped))


#: Calls whose body is inlined in a shard_map's body moved onto another mesh (its types were the old mesh's):
#: primitive -> the parameter holding the body. The program is differentiated already: a custom rule's body
#: is all that runs.
_INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "checkpoint": "jaxpr",
            "remat": "jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


def _bind_here(eqn: Any, ins: list, dropped: frozenset[str] = frozenset()) -> list:
    body = eqn.params.get(_INLINED.get(eqn.primitive.name, ""))
    if body is not None:
        inner = getattr(body, "jaxpr", body)
        return interpret(inner, getattr(body, "consts", ()), ins, functools.partial(_bind_here, dropped=dropped))
    params = eqn.primitive.get_bind_params(eqn.params)
    if dropped:
        done, params = _without_axes(eqn, ins, params, dropped)
        if done is not None:
            return done
    mesh = jax.sharding.get_abstract_mesh()
    with equation_context(eqn), abstract_mesh_context(mesh):
        outs = eqn.primitive.bind(*ins, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


#: Collectives over named axes whose result over size-1 axes alone is their input (``axes``: the names)
_IDENTITY_OVER_ONE = {"psum", "psum_invariant", "pmax", "pmin", "pvary", "pbroadcast"}


def _without_axes(eqn: Any, ins: list, params: dict, dropped: frozenset[str]) -> tuple[list | None, dict]:
    """A collective of the body with the size-1 axes ``dropped`` left out: ``(outputs, params)``, outputs
    when that leaves nothing to do (a psum over them alone: its inputs; their axis_index: 0)."""
    name = eqn.primitive.name
    if "axes" in params and isinstance(params["axes"], tuple):
        kept = tuple(a for a in params["axes"] if a not in dropped)
        if kept == params["axes"]:
            return None, params
        if not kept and name in _IDENTITY_OVER_ONE:
            return list(ins), params
        if kept and name in _IDENTITY_OVER_ONE:
            return None, {**params, "axes": kept}
    elif "axis_name" in params:
        given = params["axis_name"]
        names = given if isinstance(given, tuple) else (given,)
        kept = tuple(a for a in names if a not in dropped)
        if kept == names:
            return None, params
        if name == "axis_index" and not kept:
            return [jax.numpy.zeros((), jax.numpy.int32)], params
        if kept and name in ("all_gather", "ppermute", "psum_scatter", "reduce_scatter", "all_to_all"):
            return None, {**params, "axis_name": kept if isinstance(given, tuple) else kept[0]}
    else:
        return None, params
    raise StageAxisError(f"a shard_map's {name} over the size-1 axes {sorted(dropped)}, which the stage lacks: "
                         f"only psum/pmax/pmin over them and their axis_index can be dropped; keep the axes on "
                         f"the stage's submesh (size 1)")


def _check_sizes(what: str, call: ShardMapCall, named: set[str], stage: Placement) -> None:
    """The body was traced with each device's part of its inputs: an axis the specs name must split them as
    much on the stage as on the mesh it was traced on."""
    sizes, here = dict(call.mesh.shape), dict(stage.mesh.shape)
    differ = sorted(a for a in named if sizes.get(a) != here[a])
    if differ:
        shown = ", ".join(f"{a!r}: {sizes.get(a)} -> {here[a]}" for a in differ)
        raise StageAxisError(
            f"{what}, traced on the mesh {sizes}, runs on the stage {stage.describe()}, whose axes its specs name "
            f"have other sizes ({shown}): its body was traced for each device's part on the first, and stages "
            f"chosen by register_task(params=...) are known only after tracing; the step is traced again on the "
            f"stages' mesh only where they have one submesh shape. Give every stage the same submesh shape, "
            f"choose the stages by scope (register_task of a named scope or module around the shard_map), which "
            f"traces it on the stage, or keep these axes' sizes on every stage")


#: The stage whose shape a pipeline of Auto axes is traced again on (`traced_on_stage`), else None.
_RETRACED_ON: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("multimesh_retraced_on",
                                                                                default=None)
#: Part of `jax.jit`'s cache key while traced again on a stage: the model's own jits (a shard_map inside one
#: defined once) are traced again there, not taken from the first trace, and what they trace there is not
#: given to the model's later calls of them elsewhere.
_STAGE_TRACE_KEY = jax.make_user_context(None)


@contextlib.contextmanager
def traced_on_stage(stage: Placement) -> Iterator[None]:
    """While a pipeline of Auto axes is traced again with its stages known (`run.parallelize`): a `shard_map`
    given a mesh, in no scope `register_task` matched, runs on ``stage``'s submesh, its body traced with the
    stage's shapes (where its segment is compiled it moves onto its own stage's devices, of that shape)."""
    token = _RETRACED_ON.set(stage)
    try:
        with _STAGE_TRACE_KEY(stage.mesh.abstract_mesh):
            yield
    finally:
        _RETRACED_ON.reset(token)


def traced_for_other_sizes(jaxpr: Any, stage_mesh: Any) -> bool:
    """Whether ``jaxpr`` (or a jaxpr it nests) holds a `shard_map` whose specs name an axis that has another
    size on ``stage_mesh`` than on the mesh it was traced on: its body, traced for each device's part there,
    cannot run on such a stage as it is (`onto_stage`)."""
    here = dict(stage_mesh.shape)
    walked: set[int] = set()  # a body called once per microbatch is read once

    def found_in(j: Any) -> bool:
        walked.add(id(j))
        for eqn in j.eqns:
            call = shard_map_call(eqn)
            if call is None:
                if any(found_in(inner) for inner in subjaxprs(eqn) if id(inner) not in walked):
                    return True
                continue
            sizes = dict(call.mesh.shape)   # (a shard_map inside its body is on its manual mesh: moved with it)
            if any(sizes.get(a) != here.get(a) for a in _spec_axes((call.in_specs, call.out_specs))):
                return True
        return False

    return found_in(jaxpr)


_ROUTING = SharedHook(lambda: set_shard_map_router(_route), lambda: set_shard_map_router(None))


def routing_stage_shard_maps() -> SharedHook:
    """A `shard_map` called while the block runs goes to the stage its trace is on (nested blocks share one
    routing)."""
    return _ROUTING


while_placed(routing_stage_shard_maps)
