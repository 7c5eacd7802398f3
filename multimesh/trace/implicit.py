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
                  callback=lambda name, backprop: ((0, 4), "first") if int(name.group(1)) < 2 else ((4, 8), "second"))
    register_task(r"layers_0", task=Task(mesh=TaskMesh(devices=(0, 1, 2, 3), axis_sizes=(2, 2), axis_names=("x", "y"))))
    register_task(params=r"embedding|layers\\.[01]", devices=jax.devices()[:4])   # a plain-pytree model

A model in plain JAX opens no scope per layer; ``params=`` names its parts by
the paths of the parameters they read instead (`param_scopes`): once the step
is traced, an equation that reads ``params.layers.0.q`` runs under the scope
``param:layers.0``, which only ``params=`` registrations match.

A callback receives the matched name (a `MatchedName`: a ``str``, as in
MultiMesh, which also offers ``.group(n)``) and may return a `Task`, a
``((start, stop), name)`` device range, or ``(devices, name)`` with
``devices`` a sequence or array of `jax.Device`s (e.g. ``my_devices[4:8]``).

Registrations are global until `clear_tasks()` (or the ``with`` block of the
handle `register_task` returns, or of `task_scope()`) ends them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import jax
import numpy as np
from jax.sharding import Mesh

from ..core.fmt import device_span
from ..core.rules import MeshAxes, Rules
from .scopes import scope_stack
from .stage_names import readable_name
from .task import Placement, make_placement
from .taskspec import Task, current_global_mesh, loop_slices

__all__ = [
    "PARAM_SCOPE",
    "MatchedName",
    "Registration",
    "clear_tasks",
    "implicit_placement",
    "is_backprop",
    "match_name",
    "match_path",
    "microbatch_of",
    "names_in",
    "pass_of",
    "placed_by",
    "placement_in_scope",
    "register_scope",
    "register_task",
    "registered_tasks",
    "scope_names",
    "split_for",
    "task_scope",
]



class MatchedName(str):
    """The name a registration matched, as MultiMesh passes it to a callback (``name.split("_")``),
    that also answers what an `re.Match` does: ``.group(n)``, ``.groups()``, ``.groupdict()``, ``.match``.

    Indexing is a ``str``'s (``name[0]`` is the first character); groups are ``name.group(1)``.
    """

    match: re.Match

    def __new__(cls, match: re.Match) -> Self:
        obj = super().__new__(cls, match.group(0))
        obj.match = match
        return obj

    def group(self, *which: int | str) -> Any:
        return self.match.group(*which)

    def groups(self, default: Any = None) -> tuple:
        return self.match.groups(default)

    def groupdict(self, default: Any = None) -> dict:
        return self.match.groupdict(default)


Callback = Callable[[MatchedName, bool],
                    "Task | tuple[tuple[int, int] | Sequence[jax.Device] | np.ndarray, str] | None"]


@dataclass(eq=False)
class Registration:
    """One `register_task` call: a name pattern and where its matches run."""

    pattern: re.Pattern
    name: str | None = None
    placement: Placement | None = None
    callback: Callback | None = None
    dims: tuple[int, ...] | None = None
    device_axes: tuple[str, ...] | None = None
    logical_axes: Rules | tuple | None = None
    task: Task | None = None
    #: the global mesh a `Task`'s ``mesh_slice`` slices (the `MultiMesh` registered on; None: the one in force)
    global_mesh: Mesh | None = None
    #: ``split=``: ``((first, stop), where)`` per layer range of a scanned stack (`plan.scan_split`)
    split: tuple[tuple[tuple[int, int], Any], ...] | None = None
    #: ``params=``: the pattern is matched against the paths of the parameters an equation reads (`match_path`),
    #: through the ``param:`` scopes `param_scopes` gives them, not against scope names
    params: bool = False
    _cache: dict = field(default_factory=dict, repr=False)
    #: registrations whose matches inside this one's were warned about (`_warn_shadowed`): once each
    _shadowed: set = field(default_factory=set, repr=False)

    @property
    def call(self) -> str:
        """How it was registered, for messages: ``register_task('layers_3')``, ``register_task(params='...')``."""
        return f"register_task({'params=' if self.params else ''}{self.pattern.pattern!r})"

    def placement_for(self, match: re.Match, backprop: bool, iteration: int | None = None) -> Placement | None:
        """Where ``match`` runs (``iteration``: its `microbatch` index, for loop-dependent slices).

        A ``split=`` registration places no equation whole (None): its scans are split by the planner.
        """
        if self.split is not None:
            return None
        if self.callback is None and self.task is None:
            return self.placement
        key = (match.group(0), backprop)
        if key not in self._cache:  # the callback is asked once per name and direction
            callback = self.callback
            got = self.task if callback is None else self._resolve(callback(MatchedName(match), backprop), match)
            self._cache[key] = got
        got = self._cache[key]
        if not isinstance(got, Task):
            return got
        if got.loop_dependent_mesh_slice is None:
            iteration = None
        mesh = self.global_mesh or current_global_mesh()  # relative device numbers index its devices
        if (key, iteration, mesh) not in self._cache:
            default = match.group(0) if self.callback is not None else readable_name(self.pattern)
            self._cache[(key, iteration, mesh)] = got.placement(self.name or default, global_mesh=mesh,
                                                                iteration=iteration)
        return self._cache[(key, iteration, mesh)]

    def split_parts(self, match: re.Match) -> list[tuple[tuple[int, int], Placement]]:
        """``split=`` resolved: ``((first, stop), placement)`` per layer range, in the order given."""
        key = ("split", match.group(0))
        if key not in self._cache:
            parts = []
            for (first, stop), where in self.split or ():
                got = where if isinstance(where, (Placement, Task)) else self._resolve(where, match)
                if got is None:
                    raise ValueError(f"{self.call}: split= places layers "
                                     f"[{first}, {stop}) nowhere (None); give every range a placement")
                if isinstance(got, Task):
                    got = got.placement(self.name or f"{match.group(0)}[{first}:{stop}]",
                                        global_mesh=self.global_mesh or current_global_mesh())
                parts.append(((first, stop), got))
            self._cache[key] = parts
        return self._cache[key]

    def _resolve(self, got: Any, match: re.Match) -> Placement | Task | None:
        """A callback's answer (a Task, ``((start, stop), name)``, ``(devices, name)`` or None) as a placement."""
        if got is None or isinstance(got, Task):
            return got
        who = self.call
        try:
            where, name = got
        except (TypeError, ValueError):
            raise ValueError(
                f"{who}: {'split= values must be' if self.split is not None else 'callback must return'} a "
                f"Task, ((start, stop), name), (devices, name) or None, got {got!r} for {match.group(0)!r}"
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        where = self.placement.describe() if self.placement is not None else f"callback {self.callback!r}"
        if self.split is not None:
            where = f"split {[r for r, _ in self.split]}"
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
    regex: str | None = None,
    *,
    matcher: str | None = None,
    name: str | None = None,
    mesh: Mesh | None = None,
    dims: Sequence[int] | None = None,
    callback: Callback | None = None,
    devices: Any = None,
    device_axes: Sequence[str] | None = None,
    logical_axes: Iterable[tuple[str, MeshAxes]] | None = None,
    task: Task | None = None,
    split: Any = None,
    params: str | None = None,
) -> Registration:
    """Run every Flax module (or `jax.named_scope`) whose name fully matches ``regex`` as a task.

    Args:
      regex: matched (`re.fullmatch`) against each name in an equation's scope
        stack, outermost first: a Linen module's name (``"layers_3"``), a named
        scope, or a Flax NNX submodule's attribute path from the model, parts
        joined with ``.`` (``"blocks.3"``, ``"blocks.3.mlp"``; see `trace.nnx_scopes`).
        A module's other methods than ``__call__`` run under ``module.method``
        (Linen's ``"embed.attend"``, NNX's ``"embedder.attend"``): a pattern for
        the module matches them too, and a pattern for the whole
        ``module.method`` name takes precedence over it.
        The outermost match wins (on one name, the first registered): an equation
        inside ``decoder/layers_3`` runs where the registration of ``decoder``
        places it, and a registration of ``layers_3`` that would place it
        elsewhere is warned about, naming both patterns.
        (MultiMesh v0.2 calls it ``matcher``, accepted as a keyword too.)
      params: instead of ``regex``, a pattern over the *paths of the
        parameters* an equation reads, for a model that opens no scope per
        part (plain JAX: parameters a pytree of dataclasses, dicts or lists).
        A path is the step input's pytree path, its keys joined with ``.``
        (``params.layers.1.q``, ``opt.0.trace.layers.1.q``); the pattern
        matches when it fully matches whole consecutive keys of it
        (``layers\\.[01]``: ``layers.0`` or ``layers.1``, not ``layers.10``).
        Equations reading matching parameters run on the task, forward and
        backward (and the optimizer's update of them); the activations between
        (a norm's statistics, residual adds, the softmax) and each weight's
        gradient go where the planner's colouring puts glue: with the equation
        that consumes them. A pattern matching no path is an error naming the
        paths there are. A scope name match (``regex``) outside it wins.
        See `trace.param_scopes`.
      name: the task's name in plans, run stats, schedules and errors (default: the names ``regex``
        matches, numbered ones as ranges, ``stem+block.0-1`` for ``r"stem|block\\.[01]"``; a pattern
        matching unboundedly many by its fixed text, ``layers_*`` for ``r"layers_(\\d+)"``: see
        `trace.stage_names`).
      task: where matches run, as a `Task` (MultiMesh v0.2); or
      mesh: a fixed placement's mesh, as for `task`.
      devices: instead of ``mesh``, as for `task`; integer device ids too,
        reshaped to ``dims`` when given.
      device_axes: the axis names of ``devices``' submesh, as for `task`.
      logical_axes: the rules of the task's submesh, as for `task`.
      callback: ``callback(name, backprop)``, ``name`` the matched text (a
        `MatchedName`: a str with ``.group(n)``), ``backprop`` whether the
        equation belongs to the backward pass. It returns a `Task`, or
        ``((start, stop), name)``: ``jax.devices()[start:stop]`` shaped ``dims``
        with axes ``device_axes`` and rules ``logical_axes``, or ``(devices, name)``
        with ``devices`` a sequence or array of `jax.Device`s (reshaped to ``dims``
        when given, else used as shaped), or None (not a task).
      dims: the submesh shape (default: 1-D, or the shape of ``devices``).
      split: split a *scanned* layer stack (``nn.scan``, ``jax.lax.scan``) whose
        scope matches over several submeshes: ``{(first, stop): where, ...}`` (or
        a sequence of such pairs), layers ``[first, stop)`` on ``where``, which
        is what a callback returns (``((start, stop), name)``, ``(devices,
        name)``, a `Task`), shaped by ``dims``/``device_axes``/``logical_axes``.
        The ranges cover the stack in order; the stacked parameters live split
        over the parts' submeshes (`multimesh.plan.scan_split`).

    Inside a `MultiMesh` (or `Context`) block, the registration belongs to it
    and ends when the block ends.

    Returns:
      A handle: ``.remove()`` unregisters, and ``with register_task(...):`` scopes it.
    """
    if sum(p is not None for p in (regex, matcher, params)) != 1:
        raise TypeError("register_task needs the name pattern: register_task(regex, ...) or "
                        "register_task(matcher=...), or a pattern over the paths of the parameters equations read: "
                        "register_task(params=...); give exactly one")
    pattern = next(p for p in (regex, matcher, params) if p is not None)
    reg = make_registration(pattern, name=name, mesh=mesh, dims=dims, callback=callback, devices=devices,
                            device_axes=device_axes, logical_axes=logical_axes, task=task, split=split,
                            params=params is not None)
    if _CONTEXTS:
        _CONTEXTS[-1].adopt(reg)
    add_registration(reg)
    return reg


def make_registration(
    regex: str,
    *,
    name: str | None = None,
    mesh: Mesh | None = None,
    dims: Sequence[int] | None = None,
    callback: Callback | None = None,
    devices: Any = None,
    device_axes: Sequence[str] | None = None,
    logical_axes: Iterable[tuple[str, MeshAxes]] | None = None,
    task: Task | None = None,
    global_mesh: Mesh | None = None,
    split: Any = None,
    params: bool = False,
) -> Registration:
    """A `Registration` checked and built, not yet in force (`add_registration`); ``params``: ``regex`` is
    matched against parameter paths (`match_path`)."""
    try:
        pattern = re.compile(regex)
    except (re.error, TypeError) as e:
        what = (f"params={regex!r} is not a valid regular expression ({e}); it is matched against parameter "
                f"paths, e.g. r'layers\\.[01]'" if params else
                f"regex={regex!r} is not a valid regular expression ({e}); it is matched against Flax module names "
                f"and jax.named_scope names, e.g. r'layers_(\\d+)'")
        raise ValueError(f"register_task: {what}") from None
    axes = tuple(device_axes) if device_axes is not None else None
    rules = logical_axes if isinstance(logical_axes, Rules) or logical_axes is None else tuple(logical_axes)
    who = f"register_task({'params=' if params else ''}{regex!r})"
    if split is not None and params:
        raise ValueError(f"{who}: split= splits a scanned stack found by its scope name; give it with a name "
                         f"pattern, register_task(regex, split=...), not params=")
    if split is not None:
        if task is not None or callback is not None or mesh is not None or devices is not None:
            raise ValueError(f"{who}: split= says where each layer range runs; give it without task=, callback=, "
                             f"mesh= or devices= (dims=, device_axes=, logical_axes= shape its device ranges)")
        return Registration(pattern, name, None, None, tuple(dims) if dims is not None else None, axes, rules,
                            global_mesh=global_mesh, split=_check_split(split, who))
    if task is not None:
        if not isinstance(task, Task):
            raise TypeError(f"{who}: task= must be a multimesh Task, got {task!r}")
        if callback is not None or any(x is not None for x in (mesh, dims, devices, axes, rules)):
            raise ValueError(f"{who}: task= says where matches run; give it alone, or use callback=/mesh=/devices=")
        # a mesh_slice slices the global mesh in force where a name is matched, while the step is traced
        # (`Registration.placement_for`): it may be registered before that mesh is entered, as in MultiMesh
        return Registration(pattern, name or task.name, None, None, task=task, global_mesh=global_mesh,
                            params=params)
    if callback is not None:
        if mesh is not None or devices is not None:
            raise ValueError(f"{who}: give callback= or mesh=/devices=, not both")
        if not callable(callback):
            raise TypeError(f"{who}: callback must be callable, got {callback!r}")
        return Registration(pattern, name, None, callback, tuple(dims) if dims is not None else None, axes, rules,
                            global_mesh=global_mesh, params=params)
    if dims is not None:
        if devices is None:
            raise ValueError(f"{who}: dims={tuple(dims)} shapes devices=; give devices= too (or mesh=)")
        arr = np.asarray(devices, dtype=object)
        if math.prod(dims) != arr.size:
            raise ValueError(f"{who}: dims={tuple(dims)} needs {math.prod(dims)} devices, but devices= holds "
                             f"{arr.size}")
        devices = arr.reshape(tuple(dims))
    return Registration(pattern, name, make_placement(name or readable_name(regex), mesh, devices, axes, rules),
                        global_mesh=global_mesh, params=params)


def _check_split(split: Any, who: str) -> tuple[tuple[tuple[int, int], Any], ...]:
    """``split=`` as ``((first, stop), where)`` pairs: ranges of non-negative ints, in order, not overlapping."""
    items = list(split.items()) if isinstance(split, Mapping) else list(split)
    example = "split={(0, 2): ((0, 4), 'stage0'), (2, 4): ((4, 8), 'stage1')}"
    out, end = [], 0
    for item in items:
        try:
            rng, where = item
            first, stop = (int(i) for i in rng)
        except (TypeError, ValueError):
            raise TypeError(f"{who}: split= maps layer ranges (first, stop) to where they run, e.g. {example}; "
                            f"got the entry {item!r}") from None
        if not end <= first < stop:
            raise ValueError(f"{who}: split= layer ranges must be non-empty, in increasing order and not "
                             f"overlapping; got {[r for r, _ in items]}")
        out.append(((first, stop), where))
        end = stop
    if len(out) < 2:
        raise ValueError(f"{who}: split= needs at least two layer ranges (one range is a plain task: use "
                         f"callback=/devices=), got {items!r}")
    return tuple(out)


def split_for(names: Sequence[str]) -> tuple[Registration, re.Match] | None:
    """The ``split=`` registration that places a scan whose scope names are ``names`` (outermost first), and
    its match; None when no registration matches or one that places it whole comes first (as `_lookup`)."""
    for n in names:
        if n in _SCOPES:
            return None
        for reg in _REGISTRY:
            m = None if reg.params else reg.pattern.fullmatch(n)
            if m:
                if reg.split is not None:
                    return reg, m
                if reg.placement_for(m, False) is not None:
                    return None
    return None


def add_registration(reg: Registration) -> None:
    """Put ``reg`` in force (after those already there)."""
    if reg not in _REGISTRY:
        _REGISTRY.append(reg)
    _lookup.cache_clear()


_CONTEXTS: list[Any] = []  # the active registration contexts (`multimesh.trace.context.Context`), innermost last


def push_context(ctx: Any) -> None:
    """``ctx`` becomes the innermost context: `register_task` calls give it their registrations (``ctx.adopt``)."""
    _CONTEXTS.append(ctx)
    _lookup.cache_clear()  # its global mesh may place Tasks' relative device numbers elsewhere


def pop_context(ctx: Any) -> None:
    if _CONTEXTS and _CONTEXTS[-1] is ctx:
        _CONTEXTS.pop()
    elif ctx in _CONTEXTS:
        _CONTEXTS.remove(ctx)
    _lookup.cache_clear()


def clear_tasks() -> None:
    """Remove every `register_task` registration."""
    _REGISTRY.clear()
    _lookup.cache_clear()


def registered_tasks() -> list[Registration]:
    """The `register_task` registrations in force, oldest first (a copy: changing it changes nothing)."""
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

#: The scope `param_scopes` gives an equation by the parameters it reads: ``param:layers.0``, matched by
#: ``params=`` registrations only (and they match nothing else).
PARAM_SCOPE = "param:"

_WRAPPER = re.compile(r"^(?:[A-Za-z_]\w*\()*([^()]*)\)*$")
_MICROBATCH = re.compile(r"microbatch_(\d+)")


def names_in(jaxpr: Any) -> set[str]:
    """Every module or named-scope name on the scope stacks of ``jaxpr``'s equations (nested ones too)."""
    names: set[str] = set()
    walked: set[int] = set()  # a body called once per microbatch is read once

    def walk(j: Any) -> None:
        walked.add(id(j))
        for e in j.eqns:
            names.update(_facts(e.source_info.name_stack)[0])
            for value in e.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns") and id(inner) not in walked:
                    walk(inner)

    walk(jaxpr)
    return names


@functools.lru_cache(maxsize=1 << 16)
def _read_stack(name_stack: Any) -> tuple[tuple[str, ...], int | None, bool, str]:
    """(scope names, microbatch index, inside a transpose, the text): read once per distinct name stack.

    A pipeline's plan asks these of every equation several times, and of thousands of equations with
    many microbatches: writing the stack out as text each time was most of that cost."""
    text = str(name_stack)
    names = []
    for part in text.split("/") if text else ():
        m = _WRAPPER.match(part)
        names.append(m.group(1) if m else part)
    microbatch = next((int(m.group(1)) for n in names if (m := _MICROBATCH.fullmatch(n))), None)
    return tuple(names), microbatch, "transpose(" in text, text


#: `_read_stack`'s answers by the stack object's identity (the object kept, so that its id is not reused):
#: a plan asks about each of its (shared) stacks several times, and hashing a stack by value walks it.
_BY_IDENTITY: dict[int, tuple[Any, tuple[tuple[str, ...], int | None, bool, str]]] = {}


def _facts(name_stack: Any) -> tuple[tuple[str, ...], int | None, bool, str]:
    seen = _BY_IDENTITY.get(id(name_stack))
    if seen is not None and seen[0] is name_stack:
        return seen[1]
    facts = _read_stack(name_stack)
    if len(_BY_IDENTITY) >= 1 << 16:
        _BY_IDENTITY.clear()
    _BY_IDENTITY[id(name_stack)] = (name_stack, facts)
    return facts


def scope_names(name_stack: Any) -> list[str]:
    """The scope names of a name stack, outermost first, without transform wrappers."""
    return list(_facts(name_stack)[0])


def is_backprop(name_stack: Any) -> bool:
    return _facts(name_stack)[2]


def microbatch_of(name_stack: Any) -> int | None:
    return _facts(name_stack)[1]


def pass_of(name_stack: Any) -> tuple[int | None, bool]:
    """``(microbatch_of, is_backprop)`` of a scope stack, read at once."""
    facts = _facts(name_stack)
    return facts[1], facts[2]


def placement_in_scope() -> Placement | None:
    """The placement the registrations give the JAX name stack being traced now (None: none matches)."""
    return implicit_placement(scope_stack())


def implicit_placement(name_stack: Any) -> Placement | None:
    """The placement of an equation with this scope stack, or None when no registration matches."""
    if not _REGISTRY and not _SCOPES:
        return None
    names, iteration, backprop, text = _facts(name_stack)
    # the global mesh is part of the key: a Task's mesh_slice slices the one in force (JAX's mesh in context too)
    found = _lookup(text, backprop, current_global_mesh(), names, iteration)
    return found[0] if found is not None else None


def placed_by(name_stack: Any) -> tuple[str, Registration | None] | None:
    """The scope name whose match placed an equation with this scope stack, and the registration that
    matched it (None for a `flax.task` class); None when no registration places it."""
    if not _REGISTRY and not _SCOPES:
        return None
    names, iteration, backprop, text = _facts(name_stack)
    found = _lookup(text, backprop, current_global_mesh(), names, iteration)
    return found[1:] if found is not None else None


def match_name(pattern: re.Pattern, name: str) -> re.Match | None:
    """``pattern`` against one scope name. Flax Linen (and, while traced, NNX: `nnx_scopes`) runs a module's
    methods other than ``__call__`` under ``module.method`` (``embed.attend``): a pattern that matches the
    module matches its methods too."""
    m = pattern.fullmatch(name)
    if m is None and "." in name:
        m = pattern.fullmatch(name.rsplit(".", 1)[0])
    return m


def match_path(pattern: re.Pattern, path: str) -> re.Match | None:
    """``pattern`` against a parameter path (``params.layers.1.q``): the match of the first run of whole
    consecutive keys it fully matches (``layers.1``), leftmost, then longest; None when none."""
    keys = path.split(".")
    for first in range(len(keys)):
        for stop in range(len(keys), first, -1):
            if m := pattern.fullmatch(".".join(keys[first:stop])):
                return m
    return None


def _matches(name: str) -> list[tuple[str, Registration, re.Match, bool]]:
    """``(name, registration, match, whole)`` for the registrations matching one scope name, in priority
    order: those matching the whole name (``embed.attend``: ``whole``), then those matching its module
    (``embed``); each group in registration order. A ``param:`` scope is matched by ``params=`` registrations
    alone, on the parameter path it names."""
    if name.startswith(PARAM_SCOPE):
        path = name[len(PARAM_SCOPE):]
        return [(name, r, m, True) for r in _REGISTRY if r.params and (m := r.pattern.fullmatch(path))]
    named = [r for r in _REGISTRY if not r.params]
    whole = [(name, r, m, True) for r in named if (m := r.pattern.fullmatch(name))]
    if "." not in name:
        return whole
    module = name.rsplit(".", 1)[0]
    return whole + [(name, r, m, False) for r in named
                    if not r.pattern.fullmatch(name) and (m := r.pattern.fullmatch(module))]


@functools.lru_cache(maxsize=1 << 16)  # one entry per scope stack: 64 microbatches make some 8,400
def _lookup(text: str, backprop: bool, global_mesh: Mesh | None, names: tuple[str, ...],
            iteration: int | None) -> tuple[Placement, str, Registration | None] | None:
    """The outermost match wins: the first name of the stack (outermost first) that a registration places;
    (placement, that name, the registration), or None.

    ``global_mesh`` (the one in force) is only part of the cache key: a Task's mesh_slice slices it.
    ``names`` and ``iteration`` are the stack's (`_read_stack`), given as read: not parsed from ``text`` again."""
    for i, n in enumerate(names):
        if n in _SCOPES:  # a flax.task class; with a loop_dependent_mesh_slice, the microbatch's slice
            family = loop_slices(_SCOPES[n]) if iteration is not None else None
            return (family.at(iteration) if family is not None else _SCOPES[n]), n, None
        found = _matches(n)
        for k, (_, reg, m, whole) in enumerate(found):
            placement = reg.placement_for(m, backprop, iteration)
            if placement is not None:
                # a pattern for the whole `module.method` overrides the module's on purpose: not warned about
                later = [hit for hit in found[k + 1:] if hit[3] == whole]
                later += [hit for inner in names[i + 1:] for hit in _matches(inner)]
                _warn_shadowed(reg, n, placement, later, backprop, iteration)
                return placement, n, reg
    return None


def _warn_shadowed(winner: Registration, name: str, placement: Placement,
                   later: list[tuple[str, Registration, re.Match, bool]], backprop: bool,
                   iteration: int | None) -> None:
    """Warn (once per pair of registrations) that a registration matching a name inside ``name`` (or ``name``
    itself, with less priority) would have placed it elsewhere, but ``winner``'s outer match placed it first."""
    for inner, reg, m, _ in later:
        if reg is winner or reg in winner._shadowed:
            continue
        try:
            other = reg.placement_for(m, backprop, iteration)
        except Exception:  # noqa: BLE001  a callback asked about a name it never places: not this warning's to raise
            continue
        if other is None or other == placement:
            continue
        winner._shadowed.add(reg)
        where = f"inside {name!r}, which" if inner != name else "but"
        warnings.warn(
            f"{reg.call} matches {inner!r}, {where} {winner.call} already places on {placement.describe()}: the "
            f"outermost match (then the first registered) wins, so {inner!r} does not run on {other.describe()}; "
            f"narrow "
            f"{winner.pattern.pattern!r} (e.g. leave {name!r} out of it) to let the inner registration place it",
            stacklevel=2,
        )
