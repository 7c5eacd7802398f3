"""`linen_task(Module, ...)`: a Flax Linen module class whose instances run as a task.

Public as `multimesh.jax.flax.task` (MultiMesh's name for it); `multimesh.jax.task` runs a function.

The returned class is a subclass that runs each public method under a
`jax.named_scope` registered with the task's placement; the partitioner
places everything in that scope (forward and backward) on the submesh, as
for `register_task`. Parameters, their paths and the module's behaviour are
unchanged, so the reference program (`ignore_transforms`) is the same model.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh

from ..core.rules import MeshAxes
from ..trace.implicit import register_scope
from ..trace.task import make_placement
from ..trace.taskspec import Task, TaskMesh

__all__ = ["linen_task"]

_ids = itertools.count()


def linen_task(
    module: type[nn.Module],
    name: str | None = None,
    *,
    mesh: Mesh | None = None,
    devices: Any = None,
    device_axes: Sequence[str] | None = None,
    logical_axes: Iterable[tuple[str, MeshAxes]] | None = None,
    task: Task | None = None,
    **task_fields: Any,
) -> type[nn.Module]:
    """A subclass of the Linen ``module`` whose calls run as a task on the given submesh.

    Placement keywords are those of `multimesh.jax.task`, including the v0.2
    forms: ``task=Task(...)``, ``mesh=TaskMesh(...)``, and `Task` fields as
    keywords (``mesh_slice={"stage": 0}`` needs a global mesh in force when
    the class is made: a `MultiMesh`, or JAX's mesh in context). Example::

        Stage0 = flax.task(Block, "stage0", devices=jax.devices()[:4])
        y = Stage0(features=64)(x)        # inside a model's compact method
    """
    if not (isinstance(module, type) and issubclass(module, nn.Module)):
        raise TypeError(f"flax.task needs a Flax Linen Module class, got {module!r}")
    label = name or module.__name__
    if task is not None or task_fields or isinstance(mesh, TaskMesh):
        if task is None:
            if devices is not None or device_axes is not None:
                raise ValueError(f"flax.task({module.__name__}): devices=/device_axes= do not combine with "
                                 f"mesh=TaskMesh(...) or Task fields")
            task = Task(name=label, mesh=mesh, logical_axes=logical_axes, **task_fields)
        elif task_fields or any(x is not None for x in (mesh, devices, device_axes, logical_axes)):
            raise ValueError(f"flax.task({module.__name__}): task= says where the module runs; give it alone")
        placement = task.placement(label)
    else:
        placement = make_placement(label, mesh, devices, device_axes, logical_axes)
    scope = f"task_{label}_{next(_ids)}"
    register_scope(scope, placement)

    def in_scope(method):
        @functools.wraps(method)
        def wrapped(self, *args, **kwargs):
            with jax.named_scope(scope):
                return method(self, *args, **kwargs)

        return wrapped

    own = [c for c in module.__mro__ if issubclass(c, nn.Module) and c is not nn.Module]
    names = {k for c in own for k, v in vars(c).items()
             if callable(v) and not isinstance(v, type) and (k == "__call__" or not k.startswith("_")) and k != "setup"}
    methods = {k: in_scope(getattr(module, k)) for k in names}
    cls = type(f"{module.__name__}Task", (module,), {"__module__": module.__module__, **methods})
    cls.placement = placement  # type: ignore[attr-defined]
    return cls
