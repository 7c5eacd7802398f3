"""MultiMesh v0.2's `TaskMesh` and `Task`: where a task runs, as data.

A `TaskMesh` is an abstract mesh (axis sizes and names) plus device numbers.
As in MultiMesh the numbers are *relative*: indices into the devices of the
global mesh in force (a `MultiMesh` context, else JAX's mesh in context:
``jax.set_mesh``, ``with mesh:``), else into ``jax.devices()``.
A `Task` names a task and says where it runs: on a `TaskMesh`, on a slice of
the global mesh (``mesh_slice={"stage": i}``), or on a slice chosen per loop
iteration (``loop_dependent_mesh_slice``); and with which logical rules.

`Task.placement` turns one into the `Placement` the rest of multimesh runs.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from .._compat.jax import concrete_mesh_in_context, legacy_mesh_in_context
from ..core.placement import Placement
from ..core.rules import MeshAxes, Rules, identity_rules

__all__ = ["LoopSlices", "Task", "TaskMesh", "current_global_mesh", "jax_mesh_in_context", "loop_slices",
           "slice_global_mesh", "slice_mesh_keep", "split_names", "use_global_mesh"]

DEFAULT_TASK_AXIS = "x"  # MultiMesh's axis when a Task names no mesh

_GLOBAL: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("multimesh_global_mesh", default=None)


_SPLIT_NAMES: dict[Placement, tuple[str, str]] = {}  # placements of Tasks with split_backprop
_PLACEMENTS: dict[Placement, Placement] = {}  # every placement a Task gave, by value


def split_names(placement: Placement) -> tuple[str, str] | None:
    """The ``split_backprop`` names of the `Task` that ``placement`` was made for (None: not given)."""
    return _SPLIT_NAMES.get(placement)


def current_global_mesh() -> Mesh | None:
    """The global mesh in force: the innermost active `MultiMesh`'s, else JAX's mesh in context
    (``jax.set_mesh(mesh)``, then a legacy ``with mesh:`` block); None when there is none."""
    mesh = _GLOBAL.get()
    return mesh if mesh is not None else jax_mesh_in_context()


def jax_mesh_in_context() -> Mesh | None:
    """The concrete mesh of ``jax.set_mesh``, else of a legacy ``with mesh:`` block (None: neither).

    Read from JAX's own context (``jax.sharding.get_mesh`` refuses to answer
    inside ``jax.jit``, where tasks are traced; the context is the same there).
    """
    mesh = concrete_mesh_in_context()
    if isinstance(mesh, Mesh) and not mesh.empty:
        return mesh
    legacy = legacy_mesh_in_context()
    return None if legacy.empty else legacy


class use_global_mesh:
    """Put ``mesh`` in force as the global mesh (what `MultiMesh.__enter__` does)."""

    def __init__(self, mesh: Mesh | None):
        self._mesh = mesh
        self._tokens: list = []

    def __enter__(self) -> Mesh | None:
        self._tokens.append(_GLOBAL.set(self._mesh))
        return self._mesh

    def __exit__(self, *exc: object) -> None:
        _GLOBAL.reset(self._tokens.pop())


def _device_pool(global_mesh: Mesh | None = None) -> list:
    mesh = global_mesh if global_mesh is not None else current_global_mesh()
    return list(mesh.devices.flat) if mesh is not None else list(jax.devices())


def _int_ids(devices: Any, who: str) -> tuple[int, ...]:
    try:
        flat = list(np.asarray(devices, dtype=object).flat)
    except (TypeError, ValueError):
        raise TypeError(f"{who}: devices must be a sequence of device numbers, got {devices!r}") from None
    out = []
    for d in flat:
        if isinstance(d, jax.Device):
            raise TypeError(f"{who}: devices holds jax device {d}; a TaskMesh takes device numbers (indices "
                            f"into the global mesh's devices, else jax.devices()), e.g. devices=({d.id},)")
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0:
            raise TypeError(f"{who}: devices must be non-negative integers, got {d!r} in {devices!r}")
        out.append(int(d))
    if not out:
        raise ValueError(f"{who}: devices is empty")
    repeated = sorted({i for i in out if out.count(i) > 1})
    if repeated:
        raise ValueError(f"{who}: device numbers {repeated} appear more than once in devices={tuple(out)}")
    return tuple(out)


@dataclass(frozen=True, init=False)
class TaskMesh:
    """An abstract mesh (``axis_sizes``, ``axis_names``) over device numbers ``devices``.

    ``TaskMesh(devices=(0, 1, 2, 3), axis_sizes=(2, 2), axis_names=("x", "y"))``.
    The numbers index the devices of the global mesh in force (a `MultiMesh`,
    else JAX's mesh in context), else ``jax.devices()``. Without
    ``axis_sizes`` the mesh is 1-D; a 1-D mesh without ``axis_names`` has the
    axis ``"x"``. ``abstract=`` gives sizes and names as a
    `jax.sharding.AbstractMesh`.
    """

    devices: tuple[int, ...]
    axis_sizes: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __init__(self, *, devices: Sequence[int], axis_sizes: Sequence[int] | None = None,
                 axis_names: Sequence[str] | None = None, abstract: AbstractMesh | None = None):
        ids = _int_ids(devices, "TaskMesh")
        if abstract is not None:
            if axis_sizes is not None or axis_names is not None:
                raise ValueError("TaskMesh: give abstract= or axis_sizes=/axis_names=, not both")
            axis_sizes, axis_names = tuple(abstract.axis_sizes), tuple(abstract.axis_names)
        sizes = (len(ids),) if axis_sizes is None else tuple(int(s) for s in axis_sizes)
        if axis_names is None:
            if len(sizes) != 1:
                raise ValueError(f"TaskMesh: axis_sizes={sizes} has {len(sizes)} axes; name them with axis_names=")
            axis_names = (DEFAULT_TASK_AXIS,)
        names = tuple(axis_names)
        if len(names) != len(sizes):
            raise ValueError(f"TaskMesh: axis_names={names} names {len(names)} axes but axis_sizes={sizes} has "
                             f"{len(sizes)}; give one name per size")
        if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"TaskMesh: axis_names={names} must be distinct strings")
        if any(s < 1 for s in sizes) or math.prod(sizes) != len(ids):
            raise ValueError(f"TaskMesh: axis_sizes={sizes} multiply to {math.prod(sizes)}, but devices={ids} "
                             f"holds {len(ids)} devices; the sizes must multiply to the device count")
        object.__setattr__(self, "devices", ids)
        object.__setattr__(self, "axis_sizes", sizes)
        object.__setattr__(self, "axis_names", names)

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def abstract_mesh(self) -> AbstractMesh:
        return AbstractMesh(self.axis_sizes, self.axis_names)

    def place(self, devices: Sequence[int]) -> TaskMesh:
        """The same shape and axis names on other device numbers."""
        return TaskMesh(devices=devices, axis_sizes=self.axis_sizes, axis_names=self.axis_names)

    def mesh(self, global_mesh: Mesh | None = None) -> Mesh:
        """The concrete `Mesh`: the numbers looked up in ``global_mesh``'s devices (default: the one in
        force, else ``jax.devices()``)."""
        pool = _device_pool(global_mesh)
        bad = [i for i in self.devices if i >= len(pool)]
        if bad:
            where = "the global mesh" if (global_mesh or current_global_mesh()) is not None else "jax.devices()"
            raise ValueError(f"TaskMesh{self.devices}: device numbers {bad} are out of range; {where} has "
                             f"{len(pool)} devices (numbers 0..{len(pool) - 1})")
        arr = np.empty(len(self.devices), dtype=object)
        arr[:] = [pool[i] for i in self.devices]
        return Mesh(arr.reshape(self.axis_sizes), self.axis_names)


def slice_mesh_keep(mesh: Mesh, to_slice: Mapping[str, int], who: str = "mesh_slice") -> Mesh:
    """``mesh`` at index ``i`` along each named axis, keeping that axis with size 1 (as MultiMesh does)."""
    devices = mesh.devices
    for axis, i in to_slice.items():
        if axis not in mesh.axis_names:
            raise ValueError(f"{who}={dict(to_slice)}: the global mesh {dict(mesh.shape)} has no axis {axis!r}")
        size = mesh.shape[axis]
        if not isinstance(i, (int, np.integer)) or not 0 <= i < size:
            raise ValueError(f"{who}={dict(to_slice)}: index {i!r} along {axis!r} is out of range 0..{size - 1}")
        k = mesh.axis_names.index(axis)
        devices = np.take(devices, [int(i)], axis=k)
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def slice_global_mesh(**to_slice: int) -> TaskMesh:
    """The global mesh in force sliced at ``axis=i``, as a `TaskMesh` of relative device numbers."""
    mesh = current_global_mesh()
    if mesh is None:
        raise ValueError("slice_global_mesh() needs a global mesh: call it inside `with MultiMesh(...):` "
                         "or `with jax.set_mesh(mesh):`")
    numbers = np.arange(mesh.size).reshape(mesh.devices.shape)
    sub = slice_mesh_keep(Mesh(numbers.astype(object), mesh.axis_names), to_slice, "slice_global_mesh")
    return TaskMesh(devices=[int(i) for i in sub.devices.flat], axis_sizes=sub.devices.shape,
                    axis_names=mesh.axis_names)


def _pairs(value: Any, what: str) -> tuple[tuple[str, MeshAxes], ...] | Rules | None:
    if value is None or isinstance(value, Rules):  # a Rules keeps what it knows (its generic names)
        return value
    try:
        return tuple(Rules(value).rules)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Task: {what} must be (logical, device_axis) pairs: {e}") from None


@dataclass(frozen=True)
class Task:
    """A task: its name, where it runs, and its logical rules (MultiMesh v0.2).

    Fields:
      name: the task's name (default: the function's, or the matched name).
      mesh: a `TaskMesh` (or a `jax.sharding.Mesh`); or
      mesh_slice: ``{axis: i}``: the global mesh in force (`current_global_mesh`)
        sliced at ``i`` along ``axis``, the axis kept with size 1; or
      loop_dependent_mesh_slice: ``f(iteration) -> {axis: i}``: a slice per
        `microbatch` iteration, where that microbatch's forward and backward
        run (outside a loop: ``mesh_slice`` if given, else iteration 0's);
        every iteration's slice must have the same shape.
      logical_axes: ``(logical, device_axis)`` pairs in priority order (default:
        each device axis maps to itself).
      extra_axes: more pairs, appended to ``logical_axes``.
      split_backprop: ``(input_gradient_name, weight_gradient_name)``: names of
        the two halves of the task's backward pass, which the zero-bubble
        schedules (``"zero-bubble-h1"``, ``"zero-bubble-h2"``) run apart.
    Neither ``mesh`` nor a slice: all devices in 1-D, axis ``"x"``.
    """

    name: str | None = None
    mesh: TaskMesh | Mesh | None = None
    logical_axes: Iterable[tuple[str, MeshAxes]] | None = None
    mesh_slice: Mapping[str, int] | None = None
    extra_axes: Iterable[tuple[str, MeshAxes]] = ()
    split_backprop: tuple[str, str] | None = None
    loop_dependent_mesh_slice: Callable[[int], Mapping[str, int]] | None = field(default=None, compare=False)

    def __post_init__(self):
        who = f"Task({self.name!r})"
        if self.mesh is not None and not isinstance(self.mesh, (TaskMesh, Mesh)):
            raise TypeError(f"{who}: mesh must be a TaskMesh (or a jax.sharding.Mesh), got {self.mesh!r}")
        if self.mesh is not None and (self.mesh_slice is not None or self.loop_dependent_mesh_slice is not None):
            raise ValueError(f"{who}: give mesh= or mesh_slice=/loop_dependent_mesh_slice=, not both: a task "
                             f"runs either on its own mesh or on a slice of the global mesh")
        if self.mesh_slice is not None:
            if not isinstance(self.mesh_slice, Mapping) or not self.mesh_slice:
                raise TypeError(f"{who}: mesh_slice must be a non-empty mapping {{axis: index}}, "
                                f"got {self.mesh_slice!r}")
            object.__setattr__(self, "mesh_slice", tuple(self.mesh_slice.items()))
        if self.loop_dependent_mesh_slice is not None and not callable(self.loop_dependent_mesh_slice):
            raise TypeError(f"{who}: loop_dependent_mesh_slice must be a function iteration -> {{axis: index}}")
        if self.split_backprop is not None:
            sb = tuple(self.split_backprop)
            if len(sb) != 2 or not all(isinstance(s, str) for s in sb) or sb[0] == sb[1]:
                raise ValueError(f"{who}: split_backprop must be two distinct names (input gradient, weight "
                                 f"gradient), got {self.split_backprop!r}")
            object.__setattr__(self, "split_backprop", sb)
        object.__setattr__(self, "logical_axes", _pairs(self.logical_axes, "logical_axes"))
        object.__setattr__(self, "extra_axes", _pairs(self.extra_axes, "extra_axes") or ())

    @property
    def slice(self) -> dict[str, int] | None:
        return dict(self.mesh_slice) if self.mesh_slice is not None else None

    def needs_global_mesh(self) -> bool:
        return self.mesh_slice is not None or self.loop_dependent_mesh_slice is not None

    def _slice_at(self, iteration: int | None, global_mesh: Mesh, who: str) -> Mesh:
        fixed = self.slice
        if self.loop_dependent_mesh_slice is None:
            if fixed is None:
                raise AssertionError(f"{who}: sliced without mesh_slice or loop_dependent_mesh_slice")
            return slice_mesh_keep(global_mesh, fixed, f"{who}: mesh_slice")
        base = (slice_mesh_keep(global_mesh, fixed, f"{who}: mesh_slice") if fixed is not None
                else slice_mesh_keep(global_mesh, dict(self.loop_dependent_mesh_slice(0)),
                                     f"{who}: loop_dependent_mesh_slice(0)"))
        if iteration is None:
            return base
        got = self.loop_dependent_mesh_slice(iteration)
        sub = slice_mesh_keep(global_mesh, dict(got), f"{who}: loop_dependent_mesh_slice({iteration})")
        if sub.size != base.size:
            raise ValueError(f"{who}: loop_dependent_mesh_slice({iteration}) = {dict(got)} gives {sub.size} devices, "
                             f"the task's default slice {base.size}; every iteration's slice must hold as many")
        if dict(sub.shape) != dict(base.shape):
            raise ValueError(f"{who}: loop_dependent_mesh_slice({iteration}) = {dict(got)} gives a submesh of shape "
                             f"{dict(sub.shape)}, the task's default slice {dict(base.shape)}; every iteration's "
                             f"slice must have the same shape (slice the same axes), as one program serves them all")
        return sub

    def placement(self, default_name: str = "task", *, global_mesh: Mesh | None = None,
                  iteration: int | None = None) -> Placement:
        """The `Placement` this task runs on (``iteration``: the `microbatch` index, for loop-dependent slices)."""
        name = self.name or default_name
        who = f"Task({name!r})"
        loop: LoopSlices | None = None
        if self.needs_global_mesh():
            gm = global_mesh if global_mesh is not None else current_global_mesh()
            if gm is None:
                raise ValueError(f"{who}: mesh_slice= slices the global mesh, and none is in force; call the "
                                 f"task (or trace the step its registration matches: parallelize, jax.jit) inside "
                                 f"`with MultiMesh(...):`, `with jax.set_mesh(mesh):` or `with mesh:`, or register "
                                 f"it with multi_mesh.register_task(...)")
            mesh = self._slice_at(iteration, gm, who)
            if self.loop_dependent_mesh_slice is not None:
                loop = LoopSlices(self, name, gm)
        elif isinstance(self.mesh, TaskMesh):
            mesh = self.mesh.mesh(global_mesh)
        elif isinstance(self.mesh, Mesh):
            mesh = self.mesh
        else:
            pool = np.empty(len(_device_pool(global_mesh)), dtype=object)
            pool[:] = _device_pool(global_mesh)
            mesh = Mesh(pool, (DEFAULT_TASK_AXIS,))
        rules = Rules(self.logical_axes) if self.logical_axes is not None else identity_rules(mesh.axis_names)
        rules = rules + self.extra_axes
        rules.check_mesh(dict(mesh.shape))
        placement = Placement(mesh, rules, name=name)
        # one object per distinct placement: a callback asked per direction and per microbatch gives one stage
        placement = _PLACEMENTS.setdefault(placement, placement)
        if self.split_backprop is not None:
            _SPLIT_NAMES[placement] = self.split_backprop
        if loop is not None:
            _LOOP_SLICES[placement] = loop
        return placement


@dataclass(frozen=True, eq=False)
class LoopSlices:
    """The placements of a `Task` with a ``loop_dependent_mesh_slice``: one per `microbatch` iteration.

    The task is traced once for every microbatch, on the placement of
    ``at(None)`` (`task`: of the first iteration); the planner moves each
    microbatch's copy of it onto ``at(iteration)`` (`plan.loop_slices`).
    """

    task: Task
    name: str
    global_mesh: Mesh

    def at(self, iteration: int | None) -> Placement:
        return self.task.placement(self.name, global_mesh=self.global_mesh, iteration=iteration)


_LOOP_SLICES: dict[Placement, LoopSlices] = {}  # placements of Tasks with a loop_dependent_mesh_slice


def loop_slices(placement: Placement) -> LoopSlices | None:
    """The per-iteration placements of the loop-dependent `Task` ``placement`` was made for (None: not one)."""
    return _LOOP_SLICES.get(placement)
