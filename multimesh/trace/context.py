"""MultiMesh v0.2's `Context` and `MultiMesh`: scoped task registrations and a global mesh.

A `Context` holds `register_task` registrations that are in force only while
``with context:`` runs (and takes those `register_task` makes inside it).
A `MultiMesh` is a context around a global `Mesh`: inside ``with mm:`` its
tasks are in force, ``Task(mesh_slice={"stage": i})`` slices its mesh,
logical names in `with_sharding_constraint` resolve on it, and `parallelize`
or `mjit` without a mesh use it.

    mm = MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    mm.register_task(r"layers_(\\d+)", callback=lambda name, bp: Task(
        mesh_slice={"stage": int(name.group(1)) // 2}, logical_axes=[("batch", "data")]))
    with mm:
        step, init, batch = parallelize(train_step, init_params=..., get_input_batch=...)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self

import jax
import numpy as np
from jax.sharding import Mesh

from ..core.placement import Placement, current_placement, use_placement
from ..core.rules import MeshAxes
from .implicit import (
    MatchedName,
    Registration,
    add_registration,
    clear_tasks,
    make_registration,
    match_name,
    pop_context,
    push_context,
    scope_names,
    task_scope,
)
from .scopes import scope_stack
from .task import _as_devices
from .taskspec import Task, slice_mesh_keep, use_global_mesh

__all__ = ["Context", "MultiMesh", "tasks"]


class Context:
    """Registrations in force inside ``with context:`` (re-entrant; nested contexts stack)."""

    def __init__(self) -> None:
        self._registrations: list[Registration] = []
        self._depth = 0
        self._stack = contextlib.ExitStack()

    @property
    def global_mesh(self) -> Mesh | None:
        return None

    @property
    def registrations(self) -> list[Registration]:
        return list(self._registrations)

    @property
    def active(self) -> bool:
        return self._depth > 0

    def register_task(self, matcher: str, *, name: str | None = None, mesh: Mesh | None = None,
                      dims: Sequence[int] | None = None, callback: Callable | None = None, devices: Any = None,
                      device_axes: Sequence[str] | None = None,
                      logical_axes: Iterable[tuple[str, MeshAxes]] | None = None, task: Task | None = None,
                      split: Any = None) -> Registration:
        """`register_task` into this context (every argument as there): in force only inside ``with self:``."""
        reg = make_registration(matcher, name=name, mesh=mesh, dims=dims, callback=callback, devices=devices,
                                device_axes=device_axes, logical_axes=logical_axes, task=task,
                                global_mesh=self.global_mesh, split=split)
        self._registrations.append(reg)
        if self.active:
            add_registration(reg)
        return reg

    def adopt(self, reg: Registration) -> None:
        """Take a registration made by `register_task` while this is the innermost context."""
        if reg.global_mesh is None:
            reg.global_mesh = self.global_mesh
        self._registrations.append(reg)

    def find_matching_slice_in_scope(self) -> dict[str, int] | None:
        """The ``mesh_slice`` of the registered task whose pattern matches the JAX name stack being
        traced, innermost scope first (None: none matches, or it has no slice)."""
        for name in reversed(scope_names(scope_stack())):
            for reg in self._registrations:
                m = None if reg.params else match_name(reg.pattern, name)
                if m is None:
                    continue
                got = reg.task if reg.callback is None else reg.callback(MatchedName(m), False)
                if isinstance(got, Task) and got.mesh_slice is not None:
                    return got.slice
        return None

    def _enter(self, stack: contextlib.ExitStack) -> None:
        """What entering does besides the registrations (a `MultiMesh` puts its mesh in force)."""

    def __enter__(self) -> Self:
        if self._depth == 0:
            push_context(self)
            self._stack = contextlib.ExitStack()
            for reg in self._registrations:
                add_registration(reg)
            self._enter(self._stack)
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._stack.close()
            pop_context(self)
            for reg in self._registrations:
                reg.remove()


class MultiMesh(Context):
    """A `Context` around a global mesh: ``MultiMesh(axis_sizes=, axis_names=, devices=)`` or ``global_mesh=``.

    ``devices`` are jax devices or integer ids (default: all). The object
    answers what a `Mesh` does (``shape``, ``axis_names``, ``devices``, ...).
    """

    def __init__(self, *, axis_sizes: Sequence[int] | None = None, axis_names: Sequence[str] | None = None,
                 devices: Any = None, global_mesh: Mesh | None = None):
        super().__init__()
        if global_mesh is not None:
            if any(x is not None for x in (axis_sizes, axis_names, devices)):
                raise ValueError("MultiMesh: give global_mesh= or axis_sizes=/axis_names=/devices=, not both")
            if not isinstance(global_mesh, Mesh):
                raise TypeError(f"MultiMesh: global_mesh must be a jax.sharding.Mesh, got {global_mesh!r}")
            self.mesh = global_mesh
            return
        flat = _as_devices("MultiMesh", list(np.asarray(jax.devices() if devices is None else devices,
                                                       dtype=object).flat))
        sizes = (len(flat),) if axis_sizes is None else tuple(int(s) for s in axis_sizes)
        names = ("x",) if axis_names is None and len(sizes) == 1 else axis_names
        if names is None or len(tuple(names)) != len(sizes):
            raise ValueError(f"MultiMesh: axis_names={names} must name each of axis_sizes={sizes}")
        if math.prod(sizes) != len(flat):
            raise ValueError(f"MultiMesh: axis_sizes={sizes} multiply to {math.prod(sizes)}, but there are "
                             f"{len(flat)} devices; the sizes must multiply to the device count")
        self.mesh = Mesh(np.asarray(flat, dtype=object).reshape(sizes), tuple(names))

    @property
    def global_mesh(self) -> Mesh:
        return self.mesh

    def slice(self, **to_slice: int) -> Mesh:
        """The global mesh at ``axis=i``, the axis kept with size 1."""
        return slice_mesh_keep(self.mesh, to_slice, "MultiMesh.slice")

    def single_slice_ids(self, axis: str | None = None) -> list[int]:
        """The relative device numbers of one slice (index 0) along ``axis`` (default: the first axis)."""
        axis = axis or self.mesh.axis_names[0]
        numbers = np.arange(self.mesh.size, dtype=object).reshape(self.mesh.devices.shape)
        return [int(i) for i in slice_mesh_keep(Mesh(numbers, self.mesh.axis_names), {axis: 0}).devices.flat]

    def single_slice_devices(self, axis: str | None = None) -> list:
        """The devices of one slice (index 0) along ``axis`` (default: the first axis)."""
        return list(self.slice(**{axis or self.mesh.axis_names[0]: 0}).devices.flat)

    def _enter(self, stack: contextlib.ExitStack) -> None:
        stack.enter_context(use_global_mesh(self.mesh))
        outer = current_placement()
        if outer is None:  # logical names in with_sharding_constraint resolve on the global mesh
            stack.enter_context(use_placement(Placement(self.mesh, name=None)))

    def __getattr__(self, name: str) -> Any:
        if name in ("mesh", "_registrations", "_depth", "_stack"):
            raise AttributeError(name)
        return getattr(self.mesh, name)

    def __repr__(self) -> str:
        return f"MultiMesh({dict(self.mesh.shape)}, {len(self._registrations)} registered tasks)"


@contextlib.contextmanager
def tasks(configurable: Callable[[], Callable[[], Any]]) -> Any:
    """MultiMesh's ``tasks``: no registration in force but those ``configurable()()`` makes, for the block.

    The registrations in force before come back after it.
    """
    with task_scope():
        clear_tasks()
        configurable()()
        yield
