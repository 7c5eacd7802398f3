"""`mjit`: a `jax.jit`-like entry point for functions that call tasks on different submeshes.

Unlike `parallelize` it builds nothing: it takes arguments as they are
(already sharded, on any submeshes) and keeps their shardings. On the first
call with a given signature (tree, shapes, dtypes, shardings) it traces the
function once, plans it (`plan.partition.make_plan`), and compiles it: one
`jax.jit` when the function calls no task on another submesh, else the MPMD
runtime, where each argument is read where it lives and copied only to the
other submeshes that need it. Donated arguments are given to the program of
their last use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend.core import Var
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.gc_pause import gc_paused
from ..core.keyword_hints import keyword_hints
from ..core.meshes import build_mesh
from ..core.placement import Placement, use_placement
from ..core.rules import MeshAxes, Rules
from ..plan.partition import Plan, make_plan
from ..plan.stack_layout import Boundary
from ..trace.microbatch import collect_pipelines
from ..trace.nnx_scopes import StepScopes
from ..trace.step_context import traced_in_context
from ..trace.taskspec import current_global_mesh
from .mesh_errors import explained_mesh_errors
from .runtime import Runtime
from .stacked import from_parts, part_shardings, to_parts, union_for

__all__ = ["MJitFunction", "mjit"]


def mjit(
    fun: Callable | None = None,
    *,
    mesh: Mesh | None = None,
    devices: Sequence | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    donate_argnums: int | Iterable[int] = (),
    rules: Iterable[tuple[str, MeshAxes]] | Rules | None = None,
) -> MJitFunction | Callable[[Callable], MJitFunction]:
    """Compile ``fun`` like `jax.jit`, tasks included (MultiMesh's ``mjit``).

    Args:
      fun: any function of arrays (pytrees); it may call tasks. Without it, a decorator.
      mesh: the mesh for the work outside tasks, and for logical names
        in `with_sharding_constraint` there (default: the `MultiMesh` in force,
        else all devices in 1-D, axis ``"x"``).
      devices: instead of ``mesh``, the devices of a 1-D mesh.
      in_shardings: optional, per positional argument (a prefix tree): a
        `NamedSharding`, or a `PartitionSpec` of logical names resolved on
        ``mesh`` with ``rules``; arguments are moved there first. Default:
        each argument stays as it is.
      out_shardings: the same for the outputs (default: where they are computed).
      donate_argnums: positional arguments whose buffers the function may reuse.
      rules: logical axis rules for ``mesh``.
    """
    if fun is None:
        return lambda f: mjit(f, mesh=mesh, devices=devices, in_shardings=in_shardings,  # type: ignore[return-value]
                              out_shardings=out_shardings, donate_argnums=donate_argnums, rules=rules)
    if not callable(fun):
        raise TypeError(f"mjit needs a function, got {type(fun).__name__}")
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    return MJitFunction(fun, mesh, devices, in_shardings, out_shardings, donate, rules)


@dataclass
class _Compiled:
    plan: Plan | None
    call: Callable[[list], list]
    out_tree: Any
    spmd: bool
    #: the SPMD program's `jax.jit` (None for MPMD); ``runtime``: the MPMD runtime (None for SPMD)
    jitted: Any = None
    runtime: Runtime | None = None


def _sharding_of(x: Any) -> Any:
    """An argument's sharding: a `jax.Array`'s, or a `jax.ShapeDtypeStruct`'s (an abstract argument)."""
    return x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None


def _moved(x: Any, s: Any) -> Any:
    """``x`` on sharding ``s`` (None: as it is); an abstract argument only changes its type."""
    if s is None or _sharding_of(x) == s:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    return jax.device_put(x, s)


def _committed(x: Any) -> bool:
    """Whether ``x`` is an array committed to its devices (`jax.device_put` with a sharding, a step's result)."""
    return isinstance(x, jax.Array) and x.committed


def _sharding_key(x: Any) -> Any:
    """A sharding as a cache key: ``P('y', None)`` and ``P('y')`` are the same layout."""
    s = _sharding_of(x)
    if isinstance(s, NamedSharding):
        spec = list(s.spec)
        while spec and spec[-1] is None:
            spec.pop()
        return (s.mesh, tuple(spec), s.memory_kind)
    return s


class MJitFunction:
    """What `mjit` returns: call it like the function; ``plan`` is the latest signature's plan."""

    def __init__(self, fun: Callable, mesh: Mesh | None, devices: Sequence | None, in_shardings: Any,
                 out_shardings: Any, donate: tuple[int, ...], rules: Any):
        self.fun = fun
        self._mesh, self._devices, self._rules = mesh, devices, rules
        self.in_shardings, self.out_shardings, self.donate_argnums = in_shardings, out_shardings, donate
        self._cache: dict[Any, _Compiled] = {}
        self.plan: Plan | None = None
        self.runtime: Runtime | None = None
        self.__name__ = getattr(fun, "__name__", "mjit")

    def _placement(self) -> Placement:
        mesh = self._mesh
        if mesh is None and self._devices is None:
            mesh = current_global_mesh()
        if mesh is None:
            mesh = build_mesh(None, self._devices, default_axis="x")
        return Placement(mesh, Rules(self._rules if self._rules is not None else ()), name=None)

    def _resolve(self, tree: Any, shardings: Any, placement: Placement, what: str) -> Any:
        """``shardings`` (a prefix of ``tree``) as a full tree of `NamedSharding`s or None."""
        def is_leaf(s: Any) -> bool:
            return s is None or isinstance(s, (PartitionSpec, NamedSharding))

        def one(s: Any, sub: Any) -> Any:
            def leaf(x: Any) -> Any:
                if s is None or isinstance(s, NamedSharding):
                    return s
                return placement.sharding(tuple(s), np.shape(x))

            return jax.tree.map(leaf, sub)

        if is_leaf(shardings):
            return jax.tree.map(lambda x: one(shardings, x), tree)
        try:
            return jax.tree.map(one, shardings, tree, is_leaf=is_leaf)
        except ValueError as e:
            which = "arguments" if what == "in_shardings" else "outputs"
            raise ValueError(f"mjit({self.__name__}): {what} must be a prefix of the {which}' tree: {e}") from None

    def compiled_for(self, *args: Any) -> tuple[_Compiled, tuple]:
        """The plan and programs for ``args`` (arrays, or `jax.ShapeDtypeStruct`s with shardings), built on
        the first call with their signature, and the arguments moved to ``in_shardings``; nothing runs."""
        for i in self.donate_argnums:
            if not 0 <= i < len(args):
                raise ValueError(f"mjit({self.__name__}): donate_argnums names argument {i}, but the call has "
                                 f"{len(args)} positional arguments")
        placement = self._placement()
        if self.in_shardings is not None:
            targets = self._resolve(args, self.in_shardings, placement, "in_shardings")
            args = jax.tree.map(_moved, args, targets, is_leaf=lambda s: s is None)
        flat, tree = jax.tree.flatten(args)
        key = (tree, tuple((np.shape(x), jax.numpy.result_type(x), _sharding_key(x)) for x in flat),
               placement.mesh, placement.rules)
        if key not in self._cache:
            with gc_paused():  # the whole build, as parallelize's: no collection walks its objects between phases
                self._cache[key] = self._compile(args, flat, tree, placement)
        return self._cache[key], args

    def __call__(self, *args: Any) -> Any:
        compiled, args = self.compiled_for(*args)
        self.plan = compiled.plan
        self.runtime = compiled.runtime if compiled.runtime is not None else self.runtime
        flat = jax.tree.leaves(args)
        outs = jax.tree.unflatten(compiled.out_tree, compiled.call(flat))
        if self.out_shardings is not None and not compiled.spmd:
            targets = self._resolve(outs, self.out_shardings, self._placement(), "out_shardings")
            outs = jax.tree.map(_moved, outs, targets, is_leaf=lambda s: s is None)
        return outs

    @keyword_hints
    def estimate(self, *args: Any, profile: Any = None, dtype: str | None = None, model_flops: float | None = None,
                 optimizer_paths: str | None = None) -> Any:
        """Memory per device, work and (with a hardware ``profile``) predicted time of a call with ``args``
        (arrays, or `jax.ShapeDtypeStruct`s with shardings), without running it: the options are
        `multimesh.estimate.estimate`'s (``optimizer_paths`` None: its default), see ``docs/planning.md``."""
        from ..estimate import estimate_mjit  # the estimate layer sits above this one: imported when asked

        return estimate_mjit(self, args, profile, dtype=dtype, model_flops=model_flops,
                             **({} if optimizer_paths is None else {"optimizer_paths": optimizer_paths}))

    def _compile(self, args: tuple, flat: list, tree: Any, placement: Placement) -> _Compiled:
        avals = [jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)) for x in flat]

        def trace(fun: Callable) -> tuple[Any, Any, list]:
            scopes = StepScopes()

            def traced(*leaves: Any) -> Any:  # a fresh function: JAX's trace cache cannot see our placement
                args = jax.tree.unflatten(tree, list(leaves))
                with scopes(args):  # registered tasks find NNX submodules by attribute path
                    return fun(*args)

            with use_placement(placement.deferring()), collect_pipelines() as pipelines:
                closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*avals)
            return scopes.named(closed, jax.tree.unflatten(tree, avals), f"mjit({self.__name__})"), out_shape, pipelines

        # pmap-style collectives bound to one device, a bare PartitionSpec's mesh in context, as parallelize does;
        # JAX's refusal of the code's mesh axes explained by the mesh traced on (None given: the default one)
        given = self._mesh if self._mesh is not None else current_global_mesh()
        with explained_mesh_errors(placement.mesh, given, f"mjit({self.__name__})"):
            fun, (closed, out_shape, pipelines) = traced_in_context(trace, self.fun, f"mjit({self.__name__})")
        out_tree = jax.tree.structure(out_shape)
        plan = make_plan(closed, placement, pipelines)
        donated_leaves = self._donated_leaves(args)
        if plan.placements == [placement]:
            return self._spmd(fun, plan, tree, out_tree, out_shape, placement, donated_leaves)
        if plan.boundary is not None:
            return self._split_stack(plan, plan.boundary, flat, out_tree, donated_leaves)
        donated = {plan.jaxpr.invars[i] for i in donated_leaves}
        shardings = {v: s for v, x in zip(plan.jaxpr.invars, flat)
                     if isinstance(s := _sharding_of(x), NamedSharding)}
        runtime = Runtime(plan, shardings, donated=donated)
        return _Compiled(plan, runtime, out_tree, spmd=False, runtime=runtime)

    def _split_stack(self, plan: Plan, boundary: Boundary, flat: list, out_tree: Any,
                     donated_leaves: list[int]) -> _Compiled:
        """The MPMD runtime for a plan with a split scanned stack (``boundary``, the plan's): each split
        argument is laid over its stages (`run.stacked.union_for`, a copy only if it is not already) and given
        to the plan as its per-stage parts; split outputs come back as one array over the stages."""
        unions = [None if how is None else union_for(x, how) for x, how in zip(flat, boundary.inputs)]
        own = [u if u is not None else _sharding_of(x) for x, u in zip(flat, unions)]
        shardings = {v: s for v, s in zip(plan.jaxpr.invars, part_shardings(boundary.inputs, own))
                     if isinstance(s, NamedSharding)}
        donated: set[Var] = set()
        for i in donated_leaves:
            how, first = boundary.inputs[i], boundary.plan_index(i)
            donated.update(plan.jaxpr.invars[first:first + (1 if how is None else len(how.split.ranges))])
        runtime = Runtime(plan, shardings, donated=donated)
        targets: list[NamedSharding | None] = [None] * len(boundary.outputs)

        def call(args: list) -> list:
            outs = runtime(to_parts(args, boundary.inputs, unions))
            return from_parts(outs, boundary.outputs, targets)

        return _Compiled(plan, call, out_tree, spmd=False, runtime=runtime)

    def _donated_leaves(self, args: tuple) -> list[int]:
        out: list[int] = []
        offset = 0
        for i, a in enumerate(args):
            n = len(jax.tree.leaves(a))
            if i in self.donate_argnums:
                out.extend(range(offset, offset + n))
            offset += n
        return out

    def _spmd(self, fun: Callable, plan: Plan, tree: Any, out_tree: Any, out_shape: Any, placement: Placement,
              donated: list[int]) -> _Compiled:
        def body(*leaves: Any) -> Any:
            with use_placement(placement):
                return fun(*jax.tree.unflatten(tree, list(leaves)))

        body.__name__ = self.__name__
        outs = None
        if self.out_shardings is not None:
            outs = self._resolve(out_shape, self.out_shardings, placement, "out_shardings")
        options = {} if outs is None else {"out_shardings": outs}
        jitted = jax.jit(body, donate_argnums=tuple(donated), **options)
        # an argument not committed to devices (made by jnp, a numpy array) goes where the step runs, as
        # jax.jit under jax.set_mesh puts it: else JAX compiles for its one device and the step's constraints
        # over the mesh's axes fall on that device alone
        replicated = NamedSharding(placement.mesh, PartitionSpec())

        def call(flat: list) -> list:
            return jax.tree.leaves(jitted(*(x if _committed(x) else jax.device_put(x, replicated) for x in flat)))

        return _Compiled(plan, call, out_tree, spmd=True, jitted=jitted)

    @property
    def stats(self) -> Any:
        return self.runtime.stats if self.runtime is not None else None

    def __repr__(self) -> str:
        return f"mjit({self.__name__}, {len(self._cache)} compiled signatures)"
