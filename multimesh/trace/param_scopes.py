"""Place a plain-JAX model's equations by the parameters they read: ``register_task(params=...)``.

A model written in plain JAX (its parameters a pytree of dataclasses, dicts
or lists; a forward that loops over its layers) opens no `jax.named_scope`
per layer, so no scope-name pattern can put layers 0-1 on one stage and 2-3
on another. Its parameters have paths, though: the step's inputs are their
leaves, and `input_paths` follows each into the traced step and the bodies
nested in it. Once the step is traced, every equation that reads parameters
matched by a ``params=`` registration, all of one task (the forward's
``x @ q``, the backward's ``dy @ q.T``, the optimizer's update of ``q`` and
its moments), gets the scope ``param:<match>`` (``param:layers.0``)
innermost on its name stack, which `implicit` matches against ``params=``
registrations alone. An equation reading parameters of several tasks gets
none; a call's body is scoped equation by equation.

The equations between, which read no parameter (a norm's statistics, the
residual add, the attention's softmax, a weight's gradient ``x.T @ dy``),
are glue: the planner's colouring runs each with the first placed equation
that consumes its result, else with its largest placed input. Where one
stage's layers end and the next one's begin, that glue (a residual add, the
next norm's statistics, the sum of the q, k and v input gradients) runs on
either side, so a few more activations may cross than one cut would send.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, JaxprEqn

from .implicit import PARAM_SCOPE, Registration, match_path, registered_tasks
from .input_paths import SEPARATOR, NameStackWalk, leaf_paths, with_scope

__all__ = ["scope_by_params"]

_SHOWN = 24  # parameter paths an error lists


def scope_by_params(closed: ClosedJaxpr, inputs: Any, what: str) -> ClosedJaxpr:
    """``closed`` (traced from the leaves of ``inputs``, a tuple of the step's arguments) with the equations
    that read parameters of one ``params=`` registration's task under its ``param:`` scope.

    A path is taken within its argument (``params.layers.0.q`` of the first). Raises ValueError when a
    ``params=`` pattern matches no path, naming the paths there are.
    """
    registrations = [r for r in registered_tasks() if r.params]
    if not registrations:
        return closed
    paths = [p.split(SEPARATOR, 1)[1] if SEPARATOR in p else p for p in leaf_paths(inputs)]
    invars = closed.jaxpr.invars
    if len(paths) != len(invars):  # not traced from these inputs: nothing to follow
        return closed
    for reg in registrations:
        if not any(match_path(reg.pattern, p) for p in paths):
            shown = ", ".join(paths[:_SHOWN]) + (f", ... ({len(paths)} in all)" if len(paths) > _SHOWN else "")
            raise ValueError(
                f"{what}: {reg.call} matches no parameter path of the step; a pattern matches whole keys of a path "
                f"(r'layers\\.[01]' matches layers.0 in params.layers.0.q); the paths are: {shown or 'none'}")
    return _ByParams(registrations).rewrite(closed, dict(zip(invars, paths)))


class _ByParams(NameStackWalk):
    def __init__(self, registrations: Sequence[Registration]):
        self.registrations = registrations
        self._owner: dict[str, tuple[Registration, str] | None] = {}

    def owner(self, path: str) -> tuple[Registration, str] | None:
        """The first registration matching ``path`` and its match (``layers.0``), or None."""
        if path not in self._owner:
            owner = next(((r, m.group(0)) for r in self.registrations if (m := match_path(r.pattern, path))), None)
            if owner is not None and any(c in owner[1] for c in "/()"):  # a name stack's own punctuation
                raise ValueError(f"{owner[0].call} matches {owner[1]!r} in the parameter path {path!r}, whose keys "
                                 f"hold '/', '(' or ')', which a JAX name stack cannot carry; rename those keys")
            self._owner[path] = owner
        return self._owner[path]

    def task_of(self, paths: Sequence[str]) -> str | None:
        """The match (``layers.0``) when the parameters at ``paths`` belong to one task: one match, or several
        of one registration that places them all alike (no callback); else None."""
        owners = list(dict.fromkeys(o for p in paths if (o := self.owner(p)) is not None))
        if not owners:
            return None
        registration, match = owners[0]
        if len(owners) == 1 or (all(r is registration for r, _ in owners) and registration.callback is None):
            return match
        return None

    def name_stack(self, eqn: JaxprEqn, reads: Sequence[str], context: Any) -> Any:
        match = self.task_of(reads)
        return None if match is None else with_scope(eqn.source_info.name_stack, PARAM_SCOPE + match)
