"""`parallelize_on_mesh`: compile a one-device function into a sharded one, on a given mesh.

It is `multimesh.jax.parallelize` (defined in `multimesh.parallelize`) without ``layout="auto"``, whose
search lives above this layer (`multimesh.autolayout`). It checks its arguments, evaluates parameter and batch shapes
abstractly (nothing is materialised), derives every sharding from
annotations and rules, and builds the SPMD program (one `jax.jit` on one
mesh) or, when the function calls tasks, the MPMD plan.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ..core.gc_pause import gc_paused
from ..core.given_shardings import abstract_outputs
from ..core.layout import Layout, constrained_inputs, derive_layout
from ..core.meshes import MeshLike, build_mesh, explicit_axes
from ..core.placement import Placement, use_placement
from ..core.rules import MeshAxes, PathRules, Rules
from ..plan.partition import Plan, make_plan
from ..plan.stack_layout import widen_layout
from ..trace.implicit import names_in, registered_tasks
from ..trace.linen_constraints import flax_context_rules
from ..trace.microbatch import collect_pipelines
from ..trace.nnx_scopes import StepScopes
from ..trace.pattern_alternatives import unmatched_alternatives
from ..trace.stage_shard_map import traced_for_other_sizes, traced_on_stage
from ..trace.step_context import traced_in_context
from ..trace.taskspec import current_global_mesh, use_global_mesh
from .advice import mesh_axes_of, warn_everything_replicated, warn_replicated_batch
from .checks import check_arrays, check_in_place_nnx, check_outputs, checked, fun_name
from .initializers import ShardedInitializer, StepAndInit, StepFunctions, with_initializers
from .mesh_errors import explained_mesh_errors
from .mpmd import MPMDFunction, state_scalars
from .rule_coverage import constraint_names, rule_coverage, warn_rule_coverage
from .spmd import ShardedFunction

__all__ = ["BatchStep", "ParallelizeResult", "ShardedFunction", "StepAndInit", "StepFunctions", "StepOnly",
           "parallelize_on_mesh"]


def _required_positional(fn: Any) -> int:
    """How many positional arguments ``fn`` requires (0 when its signature cannot be read)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in sig.parameters.values())


def _check_zero_arg(fn: Any, name: str) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be a zero-argument function, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    required = [
        p.name
        for p in sig.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if required:
        raise TypeError(
            f"{name} must be a zero-argument function, but {getattr(fn, '__name__', fn)!r} requires "
            f"{required}; wrap it, e.g. {name}=lambda: f(key, example_input)"
        )


def parallelize_on_mesh(
    fun: Callable,
    *,
    init_params: Callable[[], Any] | None = None,
    get_input_batch: Callable[[], Any] | None = None,
    initial_batch: Any = None,
    devices: Sequence | np.ndarray | None = None,
    mesh: MeshLike = None,
    rules: Iterable[tuple[str, MeshAxes]] | Rules | None = None,
    param_rules: PathRules | dict | Iterable | None = None,
    batch_spec: tuple = ("batch",),
    donate: bool = False,
    strict: bool = False,
) -> ParallelizeResult:
    """`multimesh.jax.parallelize` on the mesh given (or in force), without the layout search: every
    argument as there; returns a `ParallelizeResult`."""
    if not callable(fun):
        raise TypeError(f"parallelize needs a function, got {type(fun).__name__}")
    if init_params is None:
        if (get_input_batch is None) == (initial_batch is None):
            raise TypeError(
                "parallelize needs get_input_batch= (a zero-argument function returning a batch) or "
                "initial_batch= (an already built batch), and init_params= when fun takes parameters")
        if _required_positional(fun) > 1:
            raise TypeError(
                f"parallelize: {getattr(fun, '__name__', 'fun')!r} takes (params, batch), so it needs "
                f"init_params= (a zero-argument function returning the parameters); init_params may be left out "
                f"only for a fun(batch) without parameters")
        made = parallelize_on_mesh(_batch_only(fun), init_params=tuple, get_input_batch=get_input_batch,
                           initial_batch=initial_batch, devices=devices, mesh=mesh, rules=rules,
                           param_rules=param_rules, batch_spec=batch_spec, donate=donate, strict=strict)
        if len(made) == 3:
            return BatchStep(BatchFunction(made[0]), made[2])
        return StepOnly(BatchFunction(made[0]))
    _check_zero_arg(init_params, "init_params")
    if (get_input_batch is None) == (initial_batch is None):
        raise TypeError(
            "parallelize needs exactly one of get_input_batch= (a zero-argument function returning a batch) "
            "or initial_batch= (an already built batch)"
        )
    if get_input_batch is not None:
        _check_zero_arg(get_input_batch, "get_input_batch")

    # The trace, the plan and the runtime make one large structure: the collector walks it once, after, not after
    # each phase (a `with`, not a decorator: the warnings here name the caller's line by their stack level)
    with gc_paused():
        if mesh is None and devices is None and current_global_mesh() is not None:
            mesh = current_global_mesh()  # inside `with MultiMesh(...)`: its mesh
        the_mesh = build_mesh(mesh, devices)
        if rules is None:  # inside Flax's `nn.logical_axis_rules(...)`: the model's own rules
            rules = flax_context_rules(the_mesh)
        placement = Placement(the_mesh, Rules(rules if rules is not None else (), strict=strict))
        path_rules = PathRules(param_rules) if param_rules is not None else PathRules()

        with explained_mesh_errors(the_mesh, mesh):
            with use_placement(placement):
                # with the shardings their code gives their outputs (a jit's out_shardings): eval_shape omits those
                abstract_params = abstract_outputs(checked(init_params, "init_params"))
                if get_input_batch is not None:
                    abstract_batch = abstract_outputs(checked(get_input_batch, "get_input_batch"))
                else:
                    check_arrays(initial_batch, "initial_batch", "batch")
                    abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)),
                                                  initial_batch)
            # Traced once, logical constraints deferred: only the plan knows where glue runs.
            fun, traced, pipelines = _trace_in_context(
                fun, placement, *_typed(placement, abstract_params, abstract_batch, path_rules, batch_spec))
            closed, out_shape = traced if traced is not None else (None, None)
            plan = make_plan(closed, placement, pipelines) if closed is not None else None
            if plan is not None and plan.placements != [placement] and _needs_retrace_on_stages(closed, plan, the_mesh):
                closed, out_shape, plan = _retrace_on_stages(fun, plan, placement, abstract_params, abstract_batch,
                                                             path_rules, batch_spec)
        if plan is not None and plan.placements == [placement] and registered_tasks():
            _unmatched_registrations(plan, strict)
        elif plan is not None and registered_tasks():
            _unmatched_alternatives(plan)
        if plan is not None and plan.placements != [placement]:
            # The state's scalars (an optimizer's count, a metric's total, an nnx.Rngs' key) live together on the
            # last stage, not each on the stage that reads it first: the caller combines them after the step
            # (nnx.MultiMetric.compute divides a total by a count), and JAX refuses arrays on different devices.
            # One stage, not the whole mesh: a scalar moves between stages shard for shard, which is asynchronous,
            # and onto more devices by way of the host, which waits for its value.
            plan.keep_inputs_on(state_scalars(abstract_params), plan.placements[-1])
        params, batch = _input_layouts(plan, placement, abstract_params, abstract_batch, path_rules, batch_spec)

        if plan is not None and plan.placements != [placement]:  # tasks: the runtime runs the plan's segments
            pipelined = MPMDFunction(fun, plan, params, batch, abstract_params, abstract_batch,
                                     jax.tree.structure(out_shape), out_shape, donate)
            return with_initializers(pipelined, init_params, get_input_batch, None)
        if rules is None:
            warn_everything_replicated(params, batch, the_mesh, stacklevel=2)

        sharded = ShardedFunction(fun, placement, params, batch, abstract_params, abstract_batch, donate, plan)
        return with_initializers(sharded, init_params, get_input_batch, placement)


def _typed(placement: Placement, abstract_params: Any, abstract_batch: Any, path_rules: PathRules,
           batch_spec: tuple) -> tuple[Any, Any]:
    """The step's abstract inputs as it will see them: on a mesh with Explicit axes a sharding is part of
    an array's type (code may read it, ``jax.typeof(x).sharding``), so they carry the layouts that their
    annotations, path rules, own shardings or the default give them; on Auto axes, as they are."""
    if not explicit_axes(placement.mesh):
        return abstract_params, abstract_batch
    layouts = _input_layouts(None, placement, abstract_params, abstract_batch, path_rules, batch_spec, advise=False)
    return _typed_by(layouts, abstract_params, abstract_batch)


def _typed_by(layouts: tuple[Layout, Layout], abstract_params: Any, abstract_batch: Any) -> tuple[Any, Any]:
    """The abstract parameters and batch, each leaf carrying its layout's sharding in its type."""
    params, batch = (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                  layout.shardings)
                     for abstract, layout in zip((abstract_params, abstract_batch), layouts))
    return params, batch


def _needs_retrace_on_stages(closed: Any, plan: Plan, mesh: Any) -> bool:
    """Whether a pipeline is traced again on its stages' mesh: always on Explicit axes; on Auto axes where its
    stages have one shape and a `shard_map` the model called with its mesh was traced for axis sizes its stage
    lacks (its body's shapes are per device: stages by ``params=`` are known only after the first trace)."""
    if explicit_axes(mesh):
        return True
    shapes = {p.mesh.abstract_mesh for p in plan.placements}
    return len(shapes) == 1 and traced_for_other_sizes(closed.jaxpr, plan.placements[0].mesh)


def _retrace_on_stages(fun: Callable, plan: Plan, placement: Placement, abstract_params: Any, abstract_batch: Any,
                       path_rules: PathRules, batch_spec: tuple) -> tuple[Any, Any, Plan]:
    """A pipeline traced again on its stages' mesh (`_needs_retrace_on_stages`).

    Each stage runs its part of the step as a program on its own submesh, whose
    values are typed on that submesh; traced on the whole mesh, the step's
    values are typed there, and JAX refuses to mix meshes in one program. When
    every stage has one shape, axis names and types (its abstract mesh), the
    step is traced again with its inputs typed on that mesh, so that each
    stage's equations already carry the types its program gives them. On Auto
    axes the inputs carry no mesh: the model's `shard_map`s are traced on the
    stage's submesh (`traced_on_stage`), their bodies with its shapes.
    """
    explicit = explicit_axes(placement.mesh)
    shapes = {p.mesh.abstract_mesh for p in plan.placements}
    if len(shapes) != 1:
        shown = "; ".join(f"{p.name}: {dict(p.mesh.shape)} {p.mesh.axis_types}" for p in plan.placements)
        raise NotImplementedError(
            f"parallelize: a pipeline on a mesh with Explicit axes ({dict(placement.mesh.shape)}) needs stages of "
            f"one shape, axis names and axis types, and these differ: {shown}. On Explicit axes a value's type "
            f"holds its mesh's shape, and JAX refuses to combine values typed on different meshes in one function "
            f"(the loss, the optimizer's update and a gradient norm combine every stage's values). Give every "
            f"stage the same submesh shape (e.g. slices of the mesh along a 'stage' axis), or use a mesh of Auto "
            f"axes")
    stage = plan.placements[0]
    inputs = (abstract_params, abstract_batch)
    if explicit:
        layouts = _input_layouts(plan, placement, abstract_params, abstract_batch, path_rules, batch_spec,
                                 advise=False)
        inputs = _typed_by(layouts, abstract_params, abstract_batch)
    with use_placement(placement):
        whole = current_global_mesh()  # what tasks' mesh slices sliced in the first trace
    with use_global_mesh(whole), use_placement(stage.deferring()), traced_on_stage(stage), \
            collect_pipelines() as pipelines:
        closed, out_shape = _trace(fun, *inputs)
    return closed, out_shape, make_plan(closed, placement, pipelines)


def _batch_only(fun: Callable) -> Callable:
    """``fun(batch, *args)`` as a step of no parameters: ``step((), batch, *args)``."""

    def step(params: Any, batch: Any, *args: Any) -> Any:
        return fun(batch, *args)

    step.__name__ = getattr(fun, "__name__", "step")
    return step


class BatchStep(NamedTuple):
    """What `parallelize` returns for a ``fun(batch)`` with ``get_input_batch=``: ``step, get_input_batch``."""

    step: BatchFunction
    get_input_batch: ShardedInitializer


class StepOnly(NamedTuple):
    """What `parallelize` returns for a ``fun(batch)`` with ``initial_batch=``: unpack it as ``step,``."""

    step: BatchFunction


#: What `parallelize` returns: a named tuple whose first field is the step, then the sharded initializers
#: asked for. ``init_params=`` and ``get_input_batch=``: `StepFunctions` ``(step, init_params,
#: get_input_batch)``; ``init_params=`` and ``initial_batch=``: `StepAndInit` ``(step, init_params)``; a
#: ``fun(batch)`` without ``init_params=``: `BatchStep` ``(step, get_input_batch)`` or `StepOnly` ``(step,)``.
#: Each unpacks as MultiMesh's tuples do (``step, init, get_batch = parallelize(...)``).
ParallelizeResult = StepFunctions | StepAndInit | BatchStep | StepOnly


class BatchFunction:
    """What `parallelize` returns for a ``fun(batch)`` without parameters: ``fn(batch, *args)``.

    Everything else (``plan``, ``batch_shardings``, ``report``, ...) is the
    underlying sharded function's.
    """

    def __init__(self, sharded: Any):
        self.sharded = sharded

    def __call__(self, batch: Any, *args: Any) -> Any:
        return self.sharded((), batch, *args)

    def lower(self, batch: Any, *args: Any) -> Any:
        return self.sharded.lower((), batch, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sharded, name)

    def __repr__(self) -> str:
        return f"BatchFunction({self.sharded!r})"


def _unmatched_registrations(plan: Plan, strict: bool) -> None:
    """Tasks are registered, yet none matched: say so (strict: raise), naming the patterns and what was seen."""
    patterns = [r.pattern.pattern for r in registered_tasks()]
    seen = sorted(n for n in names_in(plan.step_jaxpr or plan.jaxpr) if not n.startswith("microbatch_"))
    shown = ", ".join(seen[:20]) + (f", ... ({len(seen)} in all)" if len(seen) > 20 else "")
    message = (f"parallelize: register_task patterns {patterns} match no Flax module or jax.named_scope of the "
               f"step, so it runs as one SPMD program; the names seen are: {shown or 'none'}")
    if strict:
        raise ValueError(message)
    warnings.warn(message, stacklevel=3)


def _unmatched_alternatives(plan: Plan) -> None:
    """Warn about each alternative of a registered pattern that matches no scope of the step (a typo in one
    part of ``stem|block\\.[01]`` leaves that part off the stage), naming the closest scope names."""
    alternatives = [reg for reg in registered_tasks() if not reg.params and "|" in reg.pattern.pattern]
    if not alternatives:  # no pattern has alternatives: spare reading every equation's scopes
        return
    seen = [n for n in names_in(plan.step_jaxpr or plan.jaxpr) if not n.startswith("microbatch_")]
    for reg in alternatives:
        for part, closest in unmatched_alternatives(reg.pattern.pattern, seen):
            near = f"; the closest scope names are {', '.join(map(repr, closest))}" if closest else ""
            warnings.warn(f"parallelize: alternative {part!r} of {reg.call} matches no Flax module or "
                          f"jax.named_scope of the step (its other alternatives do), so what it was meant to "
                          f"place runs elsewhere{near}", stacklevel=3)


def _input_placement(plan: Plan | None, placement: Placement, offset: int) -> Callable[[int], Placement]:
    """Step input ``offset + i`` -> where the plan keeps it: its first consumer's placement, or for the
    state's scalars the last stage (SPMD: the one placement)."""
    if plan is None or plan.placements == [placement]:
        return lambda i: placement
    return lambda i: plan.step_input_placement(offset + i)


def _input_layouts(plan: Plan | None, placement: Placement, abstract_params: Any, abstract_batch: Any,
                   path_rules: PathRules, batch_spec: tuple, *, advise: bool = True) -> tuple[Layout, Layout]:
    """Parameter and batch layouts, each input on the placement of its first consumer in the plan (SPMD:
    the one placement): from its annotations, a path rule, a constraint found in the trace, or the default.
    ``advise``: warn about a batch the rules leave replicated (once, for the step's final layouts)."""
    n_params = len(jax.tree.leaves(abstract_params))
    found = constrained_inputs(plan.step_jaxpr or plan.jaxpr) if plan is not None else {}

    def placement_of(offset: int) -> Callable[[int], Placement]:
        return _input_placement(plan, placement, offset)

    param_placement = placement_of(0)
    params = derive_layout(abstract_params, param_placement, path_rules=path_rules, what="parameter",
                           constraints={i: s for i, s in found.items() if i < n_params})
    batch = derive_layout(abstract_batch, placement_of(n_params), default=batch_spec, exact=True, what="batch",
                          constraints={i - n_params: s for i, s in found.items() if i >= n_params})
    advice: tuple[str, ...] = ()
    if advise:
        warn_replicated_batch(batch, placement_of(n_params), model_axes=mesh_axes_of(params), main=placement,
                              stacklevel=3)
        spmd = plan is None or plan.placements == [placement]
        names = constraint_names(plan.step_jaxpr or plan.jaxpr) if plan is not None and spmd else None
        advice = tuple(rule_coverage([(params, param_placement), (batch, placement_of(n_params))], placement, names))
        warn_rule_coverage(advice, stacklevel=3)
    if plan is not None and plan.boundary is not None:  # a split scanned stack: its arrays span its stages
        params = widen_layout(params, plan.boundary.inputs[:n_params])
        batch = widen_layout(batch, plan.boundary.inputs[n_params:])
    return dataclasses.replace(params, advice=advice), dataclasses.replace(batch, advice=advice)


def _trace_in_context(fun: Callable, placement: Placement, params: Any, batch: Any) -> tuple[Callable, Any, list]:
    """``fun`` traced (`_trace`) with the registered pipelines; where its code assumes what a step under
    ``jax.pmap`` or ``jax.set_mesh`` has (an axis only pmap binds, a bare `PartitionSpec`), traced again with
    it supplied (`traced_in_context`), and that ``fun`` returned for every later trace and compilation."""
    def trace(step: Callable) -> tuple[Any, list]:
        with use_placement(placement.deferring()), collect_pipelines() as pipelines:
            return _trace(step, params, batch), pipelines

    fun, (traced, pipelines) = traced_in_context(trace, fun, f"parallelize: step {fun_name(fun)!r}")
    return fun, traced, pipelines


def _trace(fun: Callable, params: Any, batch: Any):
    """The jaxpr of ``fun(params, batch)``, or None when fun needs more arguments."""
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        if _required_positional(fun) > 2:
            check_in_place_nnx(fun, params, _required_positional(fun))
            return None
        try:
            sig.bind(params, batch)
        except TypeError as e:
            raise TypeError(f"parallelize calls fun(params, batch), but {fun_name(fun)}{sig} cannot take two "
                            f"positional arguments ({e}); take the parameters first and the batch second") from None
    scopes = StepScopes()

    def traced(p, b):  # a fresh function each time: JAX's trace cache cannot see our placement
        # Registered tasks match NNX submodules by their attribute paths: scopes while tracing.
        with scopes(p):
            out = fun(p, b)
        check_outputs(out, fun)
        return out

    setattr(traced, "__wrapped__", fun)  # JAX's messages name the user's function (mypy: no attributes on functions)

    closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(params, batch)
    return scopes.named(closed, (params, batch), "parallelize"), out_shape
