"""Named scopes for Flax NNX submodules while multimesh traces a step.

Flax Linen runs every module method under a `jax.named_scope`, which is how
`register_task` finds a module's equations. Flax NNX opens none. While
`module_scopes()` is active, each call of an NNX module's ``__call__`` runs
under a `jax.named_scope` named by the module's *attribute path* from the
model: the attribute names and list or dict keys joined with `SEPARATOR`
(``blocks.3``, ``layers.0.mlp``). Another public method its class defines runs
under ``path.method`` (``embedder.attend``), as Linen runs ``embed.attend``: a
registration of the module matches it too, and one of the whole name takes
precedence (`implicit.register_task`), so the two uses of a tied embedding can
run on two stages. A method that calls another of its own module's methods
stays in the first one's scope. Nested
calls nest their scopes, each named with its whole path (``blocks.3`` then
``blocks.3.mlp``), so a registration ``blocks\\.3`` matches the block and
everything it calls, and ``blocks\\.3\\.mlp`` its MLP alone. The backward
equations carry the same names (``transpose(jvp(blocks.3))``), so the backward
of a submodule lands with its forward. The model itself is not changed.

Which module is "the model": the outermost module call (its path is the empty
path and opens no scope), or a module passed to the traced step (``roots``).
A copy that an NNX transform (``nnx.remat``, ``nnx.vmap``, ``nnx.value_and_grad``,
...) made of a module has its original's path: NNX's transforms record, while
they run, which copy stands for which original. A copy that JAX's own
transforms made (``jax.lax.scan`` over a stacked module, as Flax's guides run
one; ``jax.checkpoint`` of a module; NNX's own in tree mode) is recorded
nowhere: it has the path of the one module it is a pytree twin of; when
several are its twins, a placeholder that the parameters its equations read
rename once the step is traced (`twin_names`, through `StepScopes`).
A module under no model's attributes (made inside the step, say) opens no
scope: its equations stay in its caller's scope.

The methods are wrapped on the classes (every subclass of `nnx.Module`
defined when the block starts) for the block's duration and restored after
it, even on error; outside the block, or in another thread, the wrappers
only call through.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib
from jax.extend.core import ClosedJaxpr
from jax.tree_util import PyTreeDef

from .implicit import match_name, registered_tasks
from .input_paths import SEPARATOR, leaf_paths
from .param_scopes import scope_by_params
from .twin_names import name_twins

__all__ = ["SEPARATOR", "StepScopes", "method_scope", "module_path", "module_scopes", "scopes_for_tasks"]

_PLACEHOLDER = "multimesh-twin-"  # the scope of a copy of several twins until the data names it
_MAX_COPIES = 16  # NNX transforms nested inside each other that a copy is traced back through


def method_scope(path: str, method: str) -> str:
    """The scope a module's method runs under: ``path`` for ``__call__``, else ``path.method``
    (``embedder.attend``)."""
    return path if method == "__call__" else f"{path}{SEPARATOR}{method}"


def module_path(parts: tuple) -> str:
    """``('blocks', 3, 'mlp')`` -> ``'blocks.3.mlp'`` (the root, ``()``, is ``''``)."""
    return SEPARATOR.join(str(p) for p in parts)


class _Tracing:
    """The module calls being traced in one `module_scopes` block."""

    def __init__(self, roots: list[nnx.Module]):
        self.roots: list[tuple[nnx.Module, dict[int, str]]] = []  # kept alive: their ids stay theirs
        self.stack: list[tuple[nnx.Module, dict[int, str] | None]] = []
        #: (path, module) of every model's submodules: what a copy JAX made may be a twin of (`_twin_path`)
        self.submodules: list[tuple[str, nnx.Module]] = []
        #: placeholder scope -> the twins a copy could be of (`_twin_path`), named after tracing (`name_twins`)
        self.placeholders: dict[str, list[str]] = {}
        for root in roots:
            self._add_root(root)

    def _add_root(self, root: nnx.Module) -> dict[int, str]:
        try:
            modules = list(nnx.iter_modules(root))
        except Exception:  # a module half built, say: its calls open no scopes
            modules = []
        paths = {id(m): module_path(p) for p, m in modules}
        paths.setdefault(id(root), "")
        self.submodules.extend((module_path(p), m) for p, m in modules if p)
        self.roots.append((root, paths))
        return paths

    def _find(self, module: nnx.Module) -> tuple[dict[int, str] | None, str | None]:
        """(the path table ``module`` belongs to, its path), searching the calls in progress innermost
        first, then every model seen, then (for a copy an NNX transform made) its original's, then (for
        a copy a JAX transform made) its one twin's; (None, None) when it is in none."""
        tables = [t for _, t in reversed(self.stack) if t is not None] + [t for _, t in reversed(self.roots)]
        current: nnx.Module | None = module
        for _ in range(_MAX_COPIES):
            if current is None:
                break
            for table in tables:
                if id(current) in table:
                    return table, table[id(current)]
            current = _original_of(current)
        path = self._twin_path(module)
        if path is None:
            return None, None
        return {id(m): module_path((path, *p)) for p, m in nnx.iter_modules(module)}, path

    def _twin_path(self, copy: nnx.Module) -> str | None:
        """The path of the one module of the models seen that ``copy`` is a pytree copy of; a placeholder
        when it could be a copy of several; None when of none.

        JAX's own transforms (``jax.lax.scan`` over a stack ``nnx.vmap`` built, ``jax.checkpoint`` of a
        module; NNX's own in tree mode) hand their body a module that JAX's unflattening rebuilt: a new
        object, which no NNX context records. It has its original's pytree structure (classes, attribute
        names, static attributes) and leaves of the same shapes, or each less one axis (a scan's or vmap's
        slice). When exactly one module of the models is such a twin, the copy is named by its path; when
        several are (blocks of one structure in a loop), by a placeholder scope that `name_twins` renames
        once the step is traced, by the parameters the copy's equations read.
        """
        found = sorted({path for path, m in self.submodules if type(m) is type(copy) and _pytree_twins(m, copy)})
        if len(found) < 2:
            return found[0] if found else None
        placeholder = f"{_PLACEHOLDER}{len(self.placeholders)}"
        self.placeholders[placeholder] = found
        return placeholder

    def name_twins(self, closed: ClosedJaxpr, inputs: Any, what: str) -> ClosedJaxpr:
        """``closed`` (the step traced in this block, of the leaves of ``inputs``) with each copy of several
        twins named by the parameters its equations read (`twin_names`); a registration that names a twin
        no data singles out is told."""
        if not self.placeholders:
            return closed
        paths = leaf_paths(inputs)  # one per jaxpr input
        invars = closed.jaxpr.invars
        closed, unnamed = name_twins(closed, dict(zip(invars, paths)) if len(paths) == len(invars) else {},
                                     self.placeholders)
        for twins in dict.fromkeys(tuple(t) for t in unnamed.values()):
            registered = [r.pattern.pattern for r in registered_tasks()
                          if not r.params and any(match_name(r.pattern, p) for p in twins)]
            if registered:
                shown = ", ".join(twins[:4]) + (f", ... ({len(twins)} in all)" if len(twins) > 4 else "")
                warnings.warn(
                    f"{what}: a module copy that a JAX transform made (jax.lax.scan, jax.checkpoint, jax.vmap over "
                    f"the module) is a twin of several of the model's modules ({shown}) and reads none of their "
                    f"parameters, so its computation runs under its caller's name and register_task patterns "
                    f"{registered} do not place it; pass the module's parameters in through the transform (an NNX "
                    f"module as an argument does)", stacklevel=3)
        return closed

    @contextlib.contextmanager
    def call(self, module: nnx.Module, method: str = "__call__") -> Iterator[None]:
        if self.stack and self.stack[-1][0] is module:  # a method calling another of its own: one scope
            yield
            return
        table, path = self._find(module)
        if table is None and not self.stack:
            table, path = self._add_root(module), ""  # the model, called from the step
        self.stack.append((module, table))
        try:
            if path:
                with jax.named_scope(method_scope(path, method)):
                    yield
            else:
                yield
        finally:
            self.stack.pop()


def _pytree_twins(original: Any, copy: Any) -> bool:
    """Whether ``copy`` has ``original``'s pytree structure and leaves of its shapes or of its shapes less
    one axis (`_Tracing._twin_path`)."""
    tree: PyTreeDef  # the public name: mypy sees no type behind jax's own alias (jaxlib has no stubs)
    copy_tree: PyTreeDef
    try:
        leaves, tree = jax.tree.flatten(original)
        copy_leaves, copy_tree = jax.tree.flatten(copy)
    except Exception:  # not a pytree JAX can flatten
        return False
    return tree == copy_tree and all(_sliced_or_same(np.shape(a), np.shape(b)) for a, b in zip(leaves, copy_leaves))


def _sliced_or_same(shape: tuple, copy_shape: tuple) -> bool:
    return copy_shape == shape or any(copy_shape == shape[:i] + shape[i + 1:] for i in range(len(shape)))


def _original_of(module: nnx.Module) -> nnx.Module | None:
    """The module an NNX transform (``nnx.remat``, ``nnx.vmap``, ``nnx.jit``, ...) copied ``module`` from.

    NNX's graph-mode transforms keep, while they run, which inner object stands for which outer one
    (to write updates back); that map is read here. Flax internals: None when they are not there.
    """
    try:
        stacks = graphlib.GRAPH_CONTEXT.update_context_stacks
        for stack in stacks.values():
            for ctx in reversed(stack):
                inner, outer = ctx.inner_ref_outer_index, ctx.outer_index_outer_ref
                if inner is not None and outer is not None and module in inner:
                    return outer[inner[module]]
    except (AttributeError, KeyError, TypeError):
        pass
    return None


_ACTIVE: contextvars.ContextVar[_Tracing | None] = contextvars.ContextVar("multimesh_nnx_tracing", default=None)
_LOCK = threading.Lock()
_PATCHED: dict[tuple[type, str], Callable] = {}  # (class, method name) -> the original
_USERS = 0  # active blocks, in all threads: the last to end restores the classes


def _scoped(method: Callable, name: str) -> Callable:
    """``method`` (the class's attribute ``name``) run under its module's scope while a block is active."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracing = _ACTIVE.get()
        if tracing is None or not isinstance(self, nnx.Module):
            return method(self, *args, **kwargs)
        with tracing.call(self, name):
            return method(self, *args, **kwargs)

    return call


def _module_classes() -> list[type]:
    seen, todo = [], list(nnx.Module.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def _patch() -> None:
    for cls in _module_classes():
        for name, value in list(vars(cls).items()):
            if inspect.isfunction(value) and (name == "__call__" or not name.startswith("_")):
                _PATCHED[(cls, name)] = value
                setattr(cls, name, _scoped(value, name))


def _restore() -> None:
    for (cls, name), original in _PATCHED.items():
        setattr(cls, name, original)
    _PATCHED.clear()


@contextlib.contextmanager
def module_scopes(roots: Any = ()) -> Iterator[_Tracing]:
    """While active (in this thread), NNX module calls run under scopes named by their attribute paths; the
    block gives the trace's record, whose `_Tracing.name_twins` names the copies of twins once traced.

    ``roots``: a pytree whose `nnx.Module` nodes (the step's model, say) are models: their
    submodules are named by their paths from them, wherever they are called from.
    """
    global _USERS
    models = [x for x in jax.tree.leaves(roots, is_leaf=lambda x: isinstance(x, nnx.Module))
              if isinstance(x, nnx.Module)]
    with _LOCK:
        if _USERS == 0:
            _patch()
        _USERS += 1
    tracing = _Tracing(models)
    token = _ACTIVE.set(tracing)
    try:
        yield tracing
    finally:
        _ACTIVE.reset(token)
        with _LOCK:
            _USERS -= 1
            if _USERS == 0:
                _restore()


def scopes_for_tasks(roots: Any = ()) -> contextlib.AbstractContextManager:
    """`module_scopes` when tasks are registered (only they read the names), else a block that does nothing."""
    return module_scopes(roots) if registered_tasks() else contextlib.nullcontext()


class StepScopes:
    """`scopes_for_tasks` around a step's call while it is traced, then its twins' copies named and the
    equations that read ``params=`` registrations' parameters scoped (`param_scopes`).

    ``with scopes(roots): fun(...)`` inside the function traced; ``scopes.named(closed, inputs, what)`` on
    its jaxpr.
    """

    def __init__(self) -> None:
        self._tracing: _Tracing | None = None

    @contextlib.contextmanager
    def __call__(self, roots: Any) -> Iterator[None]:
        with scopes_for_tasks(roots) as tracing:
            self._tracing = tracing
            yield

    def named(self, closed: ClosedJaxpr, inputs: Any, what: str) -> ClosedJaxpr:
        """``closed``, traced from the leaves of ``inputs`` (a tuple of the step's arguments), its twins' copies
        named (`_Tracing.name_twins`) and the equations reading ``params=`` registrations' parameters scoped
        (`param_scopes`)."""
        if self._tracing is not None:
            closed = self._tracing.name_twins(closed, inputs, what)
        return scope_by_params(closed, inputs, what)
