"""Implicit tasks: place Flax modules or `jax.named_scope`s on submeshes by name.

Flax Linen runs every module method under a `jax.named_scope` of the module's
name, and JAX records the scope stack of every traced equation, forward and
backward (``transpose(jvp(...))``) alike. So an implicit task needs no hook
into the model: after the whole step is traced, each equation whose scope
stack contains a name matching a registration (outermost first) is placed on
that registration's submesh. The backward of a module lands on the submesh of
its forward, and its residuals are the values the forward saved: nothing is
recomputed.

    register_task(r"layers_[0-3]", devices=jax.devices()[:4])
    register_task(r"layers_(\\d+)", dims=(2, 2), device_axes=("data", "model"),
                  callback=lambda m, backprop: ((0, 4), "first") if int(m[1]) < 2 else ((4, 8), "second"))

A callback may also name the devices themselves: ``(devices, name)`` with
``devices`` a sequence or array of `jax.Device`s (e.g. ``my_devices[4:8]``).

Registrations are global until `clear_tasks()` (or the ``with`` block of the
handle `register_task` returns, or of `task_scope()`) ends them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..core.fmt import device_span
from ..core.rules import MeshAxes
from .task import Placement, make_placement

__all__ = [
    "Registration",
    "clear_tasks",
    "implicit_placement",
    "is_backprop",
    "microbatch_of",
    "names_in",
    "register_scope",
    "register_task",
    "registered_tasks",
    "scope_names",
    "task_scope",
]

Callback = Callable[[re.Match, bool], "tuple[tuple[int, int] | Sequence[jax.Device] | np.ndarray, str] | None"]


@dataclass(eq=False)
class Registration:
    """One `register_task` call: a name pattern and where its matches run."""

    pattern: re.Pattern
    name: str | None = None
    placement: Placement | None = None
    callback: Callback | None = None
    dims: tuple[int, ...] | None = None
    device_axes: tuple[str, ...] | None = None
    logical_axes: tuple | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def placement_for(self, match: re.Match, backprop: bool) -> Placement | None:
        if self.callback is None:
            return self.placement
        key = (match.group(0), backprop)
        if key not in self._cache:
            self._cache[key] = self._from_callback(match, backprop)
        return self._cache[key]

    def _from_callback(self, match: re.Match, backprop: bool) -> Placement | None:
        got = self.callback(match, backprop)
        if got is None:
            return None
        who = f"register_task({self.pattern.pattern!r})"
        try:
            where, name = got
        except (TypeError, ValueError):
            raise ValueError(
                f"{who}: callback must return ((start, stop), name), (devices, name) or None, "
                f"got {got!r} for {match.group(0)!r}"
            ) from None
        if _is_index_range(where):
            start, stop = (int(i) for i in where)
            devices = np.asarray(jax.devices()[start:stop], dtype=object)
            if len(devices) != stop - start:
                raise ValueError(
                    f"{who}: callback placed {match.group(0)!r} on devices "
                    f"{start}..{stop - 1}, but only {len(jax.devices())} devices exist"
                )
            what = f"devices {start}..{stop - 1}"
        else:
            devices = _device_array(where, f"{who}: callback for {match.group(0)!r}")
            what = f"devices {device_span(d.id for d in devices.flat)}"
        if self.dims is not None:
            if math.prod(self.dims) != devices.size:
                raise ValueError(
                    f"{who}: dims={self.dims} needs {math.prod(self.dims)} "
                    f"devices, but the callback gave {match.group(0)!r} {what} ({devices.size})"
                )
            devices = devices.reshape(self.dims)
        return _shared_placement(name, devices, self.device_axes, self.logical_axes)

    def remove(self) -> None:
        """Unregister (idempotent)."""
        if self in _REGISTRY:
            _REGISTRY.remove(self)
        _lookup.cache_clear()

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        where = self.placement.describe() if self.placement is not None else f"callback {self.callback!r}"
        return f"Registration({self.pattern.pattern!r} -> {where})"


def _is_index_range(where: Any) -> bool:
    """Whether a callback's placement is a ``(start, stop)`` pair of device indices (not devices)."""
    try:
        items = list(where)
    except TypeError:
        return False
    return len(items) == 2 and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items)


def _device_array(where: Any, who: str) -> np.ndarray:
    """``where`` as an object array of distinct `jax.Device`s, or a ValueError that starts with ``who``."""
    try:
        devices = np.asarray(where, dtype=object)
    except (TypeError, ValueError):
        devices = np.asarray([where], dtype=object)  # ragged: reported below
    bad = [d for d in devices.flat if not isinstance(d, jax.Device)]
    if devices.ndim == 0 or devices.size == 0 or bad:
        why = f": {bad[0]!r} is a {type(bad[0]).__name__}, not a jax device" if bad else ""
        raise ValueError(
            f"{who} returned {where!r} where a (start, stop) pair of device indices or a non-empty "
            f"sequence/array of jax devices belongs{why}"
        )
    ids = [d.id for d in devices.flat]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{who} returned devices {ids}, which name a device more than once")
    return devices


_placements: dict[tuple, Placement] = {}


def _shared_placement(name: str, devices: Any, device_axes: Any, logical_axes: Any) -> Placement:
    """One Placement object per distinct placement, so equal callbacks give one stage."""
    arr = np.asarray(devices, dtype=object)
    key = (name, tuple(d.id for d in arr.flat), arr.shape, device_axes, logical_axes)
    if key not in _placements:
        _placements[key] = make_placement(name, None, devices, device_axes, logical_axes)
    return _placements[key]


_REGISTRY: list[Registration] = []
_SCOPES: dict[str, Placement] = {}  # flax.task classes: permanent, not cleared by clear_tasks


def register_task(
    regex: str,
    *,
    name: str | None = None,
    mesh: Mesh | None = None,
    dims: Sequence[int] | None = None,
    callback: Callback | None = None,
    devices: Any = None,
    device_axes: Sequence[str] | None = None,
    logical_axes: Iterable[tuple[str, MeshAxes]] | None = None,
) -> Registration:
    """Run every Flax module (or `jax.named_scope`) whose name fully matches ``regex`` as a task.

    Args:
      regex: matched (`re.fullmatch`) against each name in an equation's scope
        stack, outermost first: a module's name (``"layers_3"``) or a named scope.
      name: the task's name in plans and errors (default: ``regex``).
      mesh / devices / device_axes / logical_axes: a fixed placement, as for `task`.
      callback: ``callback(match, backprop) -> ((start, stop), name)`` (or None:
        not a task): the match runs on ``jax.devices()[start:stop]`` shaped ``dims``
        with axes ``device_axes`` and rules ``logical_axes``; ``backprop`` says
        whether the equation belongs to the backward pass. The callback may
        return ``(devices, name)`` instead, ``devices`` a sequence or array of
        `jax.Device`s (reshaped to ``dims`` when given, else used as shaped).
      dims: the submesh shape for callback placements (default 1-D).

    Returns:
      A handle: ``.remove()`` unregisters, and ``with register_task(...):`` scopes it.
    """
    try:
        pattern = re.compile(regex)
    except (re.error, TypeError) as e:
        raise ValueError(f"register_task: regex={regex!r} is not a valid regular expression ({e}); it is "
                         f"matched against Flax module names and jax.named_scope names, e.g. r'layers_(\\d+)'") from None
    axes = tuple(device_axes) if device_axes is not None else None
    rules = tuple(logical_axes) if logical_axes is not None else None
    if callback is not None:
        if mesh is not None or devices is not None:
            raise ValueError(f"register_task({regex!r}): give callback= or mesh=/devices=, not both")
        if not callable(callback):
            raise TypeError(f"register_task({regex!r}): callback must be callable, got {callback!r}")
        reg = Registration(pattern, name, None, callback, tuple(dims) if dims is not None else None, axes, rules)
    else:
        if dims is not None:
            raise ValueError(f"register_task({regex!r}): dims= shapes callback placements; give it with callback=")
        reg = Registration(pattern, name, make_placement(name or regex, mesh, devices, axes, rules))
    _REGISTRY.append(reg)
    _lookup.cache_clear()
    return reg


def clear_tasks() -> None:
    """Remove every `register_task` registration."""
    _REGISTRY.clear()
    _lookup.cache_clear()


def registered_tasks() -> list[Registration]:
    return list(_REGISTRY)


@contextlib.contextmanager
def task_scope() -> Iterator[None]:
    """Registrations made inside the block end with it (those from before are kept)."""
    saved = list(_REGISTRY)
    try:
        yield
    finally:
        _REGISTRY[:] = saved
        _lookup.cache_clear()


def register_scope(scope_name: str, placement: Placement) -> None:
    """A named scope that is always a task (used by `multimesh.jax.flax.task`)."""
    _SCOPES[scope_name] = placement
    _lookup.cache_clear()


# -- reading scope stacks ------------------------------------------------------------

_WRAPPER = re.compile(r"^(?:[A-Za-z_]\w*\()*([^()]*)\)*$")
_MICROBATCH = re.compile(r"microbatch_(\d+)")


def names_in(jaxpr: Any) -> set[str]:
    """Every module or named-scope name on the scope stacks of ``jaxpr``'s equations (nested ones too)."""
    names: set[str] = set()
    for e in jaxpr.eqns:
        names.update(scope_names(e.source_info.name_stack))
        for value in e.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                names |= names_in(inner)
    return names


@functools.lru_cache(maxsize=1 << 16)
def _read_stack(name_stack: Any) -> tuple[tuple[str, ...], int | None, bool]:
    """(scope names, microbatch index, inside a transpose): read once per distinct name stack."""
    text = str(name_stack)
    names = []
    for part in text.split("/") if text else ():
        m = _WRAPPER.match(part)
        names.append(m.group(1) if m else part)
    microbatch = next((int(m.group(1)) for n in names if (m := _MICROBATCH.fullmatch(n))), None)
    return tuple(names), microbatch, "transpose(" in text


def scope_names(name_stack: Any) -> list[str]:
    """The scope names of a name stack, outermost first, without transform wrappers."""
    return list(_read_stack(name_stack)[0])


def is_backprop(name_stack: Any) -> bool:
    return _read_stack(name_stack)[2]


def microbatch_of(name_stack: Any) -> int | None:
    return _read_stack(name_stack)[1]


def implicit_placement(name_stack: Any) -> Placement | None:
    """The placement of an equation with this scope stack, or None when no registration matches."""
    if not _REGISTRY and not _SCOPES:
        return None
    return _lookup(str(name_stack), is_backprop(name_stack))


@functools.lru_cache(maxsize=4096)
def _lookup(text: str, backprop: bool) -> Placement | None:
    for n in scope_names(text):
        if n in _SCOPES:
            return _SCOPES[n]
        for reg in _REGISTRY:
            m = reg.pattern.fullmatch(n)
            if m:
                placement = reg.placement_for(m, backprop)
                if placement is not None:
                    return placement
    return None
