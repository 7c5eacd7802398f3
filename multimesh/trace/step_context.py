"""What a step's own code assumes of its context, supplied where its trace finds it missing.

A step is written for one device, or for ``jax.jit`` under ``jax.set_mesh``.
Two things such code may take for granted are not in force for every step
`parallelize` and `mjit` trace:

* ``jax.pmap``'s axis names, bound (`pmap_axes`: Flax's ImageNet ResNet);
* JAX's mesh in context. ``jax.lax.with_sharding_constraint(y, P("data",
  "model"))`` with a bare spec, as Flax's NNX guide "Scale up on multiple
  devices" writes its model, names mesh axes that JAX looks up on the mesh in
  context, and without one raises ``RuntimeError: with_sharding_constraint
  requires a non-empty mesh in context``. A mesh of Explicit axes is always in
  context while a step is traced (`core.meshes.mesh_context`); one of Auto axes
  only for a step that needs it (`core.meshes.auto_meshes_in_context`): with a
  mesh in context, Flax's boxes would apply their names as constraints
  themselves, which multimesh resolves by its rules instead. Each placement's
  mesh is the one in context: a task's code sees its submesh.

`traced_in_context` traces a step, and where JAX's error says one of these is
missing, traces it again with it supplied; the step so wrapped is the one
used from then on (every later trace, compilation and estimate).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..core.gc_pause import without_gc
from ..core.meshes import auto_meshes_in_context, mesh_context
from ..core.placement import current_placement
from .pmap_axes import unbound_axis, with_axes_of_one

__all__ = ["needs_mesh_in_context", "step_context_note", "traced_in_context", "with_mesh_in_context"]

T = TypeVar("T")
_NO_MESH = ("requires a non-empty mesh in context",        # with_sharding_constraint, jit's shardings
            "not under a mesh context is not allowed")      # reshard, out_sharding=, device_put in a trace


def needs_mesh_in_context(error: BaseException) -> bool:
    """Whether ``error`` is JAX refusing a bare `PartitionSpec` because no mesh is in context."""
    return isinstance(error, (RuntimeError, ValueError)) and any(m in str(error) for m in _NO_MESH)


def with_mesh_in_context(fun: Callable) -> Callable:
    """``fun`` run with the mesh of the placement in force in JAX's context, Auto axes included, and each task's
    submesh in context while its code runs."""

    @functools.wraps(fun)
    def in_context(*args: Any, **kwargs: Any) -> Any:
        placement = current_placement()
        with auto_meshes_in_context(), mesh_context(placement.mesh if placement is not None else None):
            return fun(*args, **kwargs)

    in_context.mesh_in_context = True  # type: ignore[attr-defined]
    return in_context


@without_gc
def traced_in_context(trace: Callable[[Callable], T], fun: Callable, where: str) -> tuple[Callable, T]:
    """``(fun, trace(fun))``; where JAX finds an axis name that only ``jax.pmap`` binds, or a bare
    `PartitionSpec` with no mesh in context, ``fun`` wrapped to supply it (`with_axes_of_one`,
    `with_mesh_in_context`) and traced again, for the caller to use from then on. ``where`` starts the
    error for a per-device value (``lax.axis_index``) that reaches the results."""
    names: list[str] = []
    mesh = False
    while True:
        bound = with_axes_of_one(fun, names) if names else fun
        bound = with_mesh_in_context(bound) if mesh else bound
        try:
            return bound, trace(bound)
        except NameError as e:
            name = unbound_axis(e)
            if name is None or name in names:
                raise
            names.append(name)
        except (RuntimeError, ValueError) as e:
            if not mesh and needs_mesh_in_context(e):
                mesh = True
                continue
            if not names or "has mapped output" not in str(e):
                raise
            listed = ", ".join(map(repr, names))
            raise ValueError(
                f"{where} computes a per-device value over pmap's axis {listed} that reaches its results, such "
                f"as lax.axis_index({names[0]!r}) folded into a random key. It runs as one device does, on the "
                f"whole batch, where that index is always 0: use the key as it is (or fold in 0); the sharded "
                f"step's random numbers then cover the whole batch, as on one device") from None


def step_context_note(fun: Callable) -> str:
    """What `traced_in_context` supplied to ``fun``, for a repr: ``", pmap axes bound to one device: 'batch'"``,
    ``", its mesh in context"``; "" for none."""
    names = getattr(fun, "axes_of_one", ())
    note = f", pmap axes bound to one device: {', '.join(map(repr, names))}" if names else ""
    return note + (", its mesh in context" if getattr(fun, "mesh_in_context", False) else "")
