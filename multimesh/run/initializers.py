"""Sharded initializers: ``init_params`` and ``get_input_batch`` compiled to create every leaf in its sharding.

Nothing is materialised whole: each leaf is an output of a `jax.jit` whose
``out_shardings`` are the step's layouts. Under MPMD the leaves span several
submeshes and one jit cannot, so each device group gets a jit of its own,
computing only its leaves, traced under its own mesh.

The jits return flat leaves, put back into the tree structure of the
abstract evaluation: an initializer that builds objects inside (an optimizer
in a `TrainState`, a bound method) builds new, unequal ones each time it is
traced, and the step was traced with the first ones.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.tree_util import PyTreeDef

from ..core.given_shardings import moved_onto
from ..core.meshes import mesh_context
from ..core.placement import Placement, use_placement
from ..trace.interpret import interpret
from .checks import fun_name

__all__ = ["ShardedInitializer", "StepAndInit", "StepFunctions", "with_initializers"]


class ShardedInitializer:
    """``make`` compiled so that each leaf is created directly in its sharding; call it with no arguments."""

    def __init__(self, make: Callable[[], Any], shardings: Any, placement: Placement | None,
                 stages: Sequence[Placement] = ()):
        functools.update_wrapper(self, make)  # its name, module and docstring are the user's function's
        self.make = make
        self.shardings = shardings
        flat, treedef = jax.tree.flatten(shardings)
        self._treedef: PyTreeDef = treedef  # the public name: mypy sees no type behind jax's own alias
        groups: dict[frozenset, list[int]] = {}
        for i, s in enumerate(flat):
            groups.setdefault(frozenset(s.device_set), []).append(i)
        self._parts = [(idx, self._part(flat, idx, placement, stages)) for idx in groups.values()]

    def _part(self, flat: list, idx: list[int], placement: Placement | None, stages: Sequence[Placement]) -> Callable:
        """One jit computing the leaves ``idx`` under the mesh they live on (``placement``'s, when given; else
        the stage's of ``stages`` on that mesh, whose rules move the initializer's own shardings there)."""
        make, n = self.make, len(flat)
        mesh = placement.mesh if placement is not None else flat[idx[0]].mesh
        where = placement or next((s for s in stages if s.mesh == mesh), None) or Placement(mesh)

        def leaves():
            with use_placement(placement):
                out = _made_on(make, where)  # traced once per device group, not once per leaf
            if len(out) != n:
                raise ValueError(f"{fun_name(make)!r} returned {len(out)} arrays when compiled, but {n} when "
                                 f"evaluated abstractly: it must build the same tree each time it is called")
            return [out[i] for i in idx]

        jitted = jax.jit(leaves, out_shardings=[flat[i] for i in idx])

        def run(method: str = "__call__") -> Any:
            with mesh_context(mesh):  # its mesh, not one the caller may have set
                return getattr(jitted, method)()

        return run

    def __call__(self) -> Any:
        out: list[Any] = [None] * self._treedef.num_leaves
        for idx, run in self._parts:
            for i, x in zip(idx, run()):
                out[i] = x
        return jax.tree.unflatten(self._treedef, out)

    def lower(self) -> Any:
        """The lowered program (`jax.stages.Lowered`), e.g. for ``.compile().memory_analysis()``; one per
        device group (a list) when the leaves live on several submeshes."""
        lowered = [run("lower") for _, run in self._parts]
        return lowered[0] if len(lowered) == 1 else lowered

    def __repr__(self) -> str:
        return (f"ShardedInitializer({_origin(self.make)}, {self._treedef.num_leaves} arrays on "
                f"{len(self._parts)} device group(s))")


def _made_on(make: Callable[[], Any], placement: Placement) -> list:
    """The leaves of ``make()``, traced under the caller's context; a jit inside it whose shardings name
    another mesh (``jax.jit(..., out_shardings=NamedSharding(model_mesh, ...))``, JAX refuses it inside a jit
    on other devices) runs with them moved onto ``placement``'s mesh, resolved as parameters are."""
    closed = jax.make_jaxpr(make)()
    closed = moved_onto(closed, placement, f"init of {fun_name(make)!r}") or closed
    return interpret(closed.jaxpr, closed.consts, [])


def _origin(fun: Callable) -> str:
    """``module.qualname`` of ``fun`` and, when Python knows it, ``file:line``."""
    name = f"{getattr(fun, '__module__', None) or '?'}.{getattr(fun, '__qualname__', None) or fun_name(fun)}"
    try:
        where = f" at {inspect.getsourcefile(fun)}:{inspect.getsourcelines(fun)[1]}"
    except (OSError, TypeError):
        where = ""
    return name + where


class StepFunctions(NamedTuple):
    """What `parallelize` returns with ``get_input_batch=``: unpack it as ``step, init_params, get_input_batch``."""

    step: Any
    init_params: ShardedInitializer
    get_input_batch: ShardedInitializer


class StepAndInit(NamedTuple):
    """What `parallelize` returns with ``initial_batch=``: unpack it as ``step, init_params``."""

    step: Any
    init_params: ShardedInitializer


def with_initializers(sharded: Any, init_params: Callable, get_input_batch: Callable | None,
                      placement: Placement | None) -> StepFunctions | StepAndInit:
    """``(sharded, init, get_batch)`` (``(sharded, init)`` without ``get_input_batch``)."""
    stages = sharded.plan.placements if placement is None else ()
    init = ShardedInitializer(init_params, sharded.param_shardings, placement, stages)
    if get_input_batch is None:
        return StepAndInit(sharded, init)
    return StepFunctions(sharded, init, ShardedInitializer(get_input_batch, sharded.batch_shardings, placement,
                                                           stages))
