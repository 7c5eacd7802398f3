"""MultiMesh's compiler contexts: `autoshard`, `enable_recomputation`, ..., and `context(...)` for several.

Each is a context manager; ``None`` leaves a setting as it is. What each
means here (MultiMesh compiles through its own XLA plugin; multimesh runs on
stock JAX, so some of its switches have nothing to switch):

* ``autoshard``: None (default) keeps multimesh's behaviour, `with_sharding_constraint`
  resolves logical names with the rules in force; ``False`` makes it exactly
  `jax.lax.with_sharding_constraint` (MultiMesh's behaviour with autoshard
  off); ``True`` is the default behaviour.
* ``enable_recomputation`` (default on): a value that crosses submeshes but is
  computed from constants alone (masks, position ids, ``zeros``, ``arange``)
  is computed again on each submesh that reads it, instead of being copied
  there (`multimesh.plan.recompute`).
* ``ignore_transforms``: as `ignore_transforms`.
* ``enable_fast_path``, ``enable_task_fusion``, ``only_fuse_loop_tasks``:
  accepted and recorded, no effect: every jit outside multimesh already runs
  natively (the fast path), and the plan always fuses each stage's work into
  one segment per pipeline unit.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from .task import ignore_transforms as _ignore_transforms

__all__ = [
    "Knobs",
    "autoshard",
    "context",
    "current_knobs",
    "enable_fast_path",
    "enable_recomputation",
    "enable_task_fusion",
    "only_fuse_loop_tasks",
]


@dataclass(frozen=True)
class Knobs:
    """The settings in force (see the module docstring)."""

    autoshard: bool | None = None
    enable_recomputation: bool = True
    enable_fast_path: bool = True
    enable_task_fusion: bool = True
    only_fuse_loop_tasks: bool = False


_DEFAULT = Knobs()
_KNOBS: contextvars.ContextVar[Knobs | None] = contextvars.ContextVar("multimesh_knobs", default=None)


def current_knobs() -> Knobs:
    return _KNOBS.get() or _DEFAULT


def _check(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None (leave as is), got {value!r}")


@contextlib.contextmanager
def context(
    autoshard: bool | None = None,
    enable_recomputation: bool | None = None,
    only_fuse_loop_tasks: bool | None = None,
    enable_task_fusion: bool | None = None,
    enable_fast_path: bool | None = None,
    ignore_transforms: bool | None = None,
) -> Iterator[Knobs]:
    """Set several knobs for the block (None: leave as is)."""
    changes = {"autoshard": autoshard, "enable_recomputation": enable_recomputation,
               "only_fuse_loop_tasks": only_fuse_loop_tasks, "enable_task_fusion": enable_task_fusion,
               "enable_fast_path": enable_fast_path}
    for name, value in {**changes, "ignore_transforms": ignore_transforms}.items():
        _check(name, value)
    knobs = dataclasses.replace(current_knobs(), **{k: v for k, v in changes.items() if v is not None})
    token = _KNOBS.set(knobs)
    try:
        with _ignore_transforms(ignore_transforms) if ignore_transforms is not None else contextlib.nullcontext():
            yield knobs
    finally:
        _KNOBS.reset(token)


def autoshard(autoshard: bool = True):
    """Logical sharding on (the default here) or off (`with_sharding_constraint` is JAX's own)."""
    return context(autoshard=autoshard)


def enable_recomputation(enable: bool | None = None):
    """Recompute constant-only values on each submesh that reads them instead of copying them (default on)."""
    return context(enable_recomputation=enable)


def enable_fast_path(enable: bool | None = None):
    """Accepted, no effect: jits outside multimesh always run natively."""
    return context(enable_fast_path=enable)


def enable_task_fusion(enable: bool | None = None):
    """Accepted, no effect: the plan always fuses a stage's work per pipeline unit (MultiMesh v0.1)."""
    return context(enable_task_fusion=enable)


def only_fuse_loop_tasks(enable: bool | None = None):
    """Accepted, no effect (MultiMesh v0.1)."""
    return context(only_fuse_loop_tasks=enable)
