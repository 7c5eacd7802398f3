"""Typos in logical names and rules: a name no rule covers, a rule no name uses.

Both are silent by nature (an array with an unknown name is simply
replicated; a rule that matches nothing does nothing) and both are usually a
misspelling (``("mpl", "model")`` for ``"mlp"``). `parallelize` warns about
each once, whatever the array's size, and its functions' `report()` lists
them. ``strict=True`` makes the first an error already; a name meant to stay
replicated takes a ``(name, None)`` rule, which silences it.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from ..core.jaxprs import subjaxprs
from ..core.layout import Layout
from ..core.meshes import spec_names
from ..core.placement import Placement

__all__ = ["constraint_names", "rule_coverage", "warn_rule_coverage"]


def constraint_names(jaxpr: Any) -> tuple[set[str], set[str]]:
    """The logical names of a traced step's deferred constraints, at any depth: (those multimesh's rules
    resolve, those of Flax hints, which Flax's own rules may resolve instead)."""
    own: set[str] = set()
    hinted: set[str] = set()
    todo = [jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            if eqn.primitive.name == "logical_constraint":
                (hinted if eqn.params.get("hint") is not None else own).update(spec_names(eqn.params["spec"]))
            todo.extend(subjaxprs(eqn))
    return own, hinted


def _hint(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def rule_coverage(layouts: Iterable[tuple[Layout, Callable[[int], Placement]]], step: Placement,
                  constraints: tuple[set[str], set[str]] | None) -> list[str]:
    """The warnings for ``layouts`` (each with the placement of its leaf ``i``) and the step's constraints.

    A logical name with no rule in the placement where it is used (and not among its rules' ``generic``)
    is named with the arrays that carry it. A rule the step was given that maps a logical name to mesh axes,
    while the name appears on no array and in no constraint, is named too; ``constraints`` None (a plan of
    tasks, whose bodies resolve their constraints as they are traced) skips that check.
    """
    missing: dict[str, list[str]] = {}
    used: set[str] = set()
    for layout, placement_for in layouts:
        for i, leaf in enumerate(layout.leaves):
            names = spec_names(leaf.logical)
            used |= names
            placement = placement_for(i)
            if not placement.own_rules or leaf.source == "default":
                continue  # no rules given there (`parallelize` says all is replicated); a batch's default spec
                # is `advice.warn_replicated_batch`'s
            for name in sorted(names - placement.rules.logical_names - placement.rules.generic):
                missing.setdefault(name, []).append(leaf.path or "<root>")
    own, hinted = constraints or (set(), set())
    used |= own | hinted
    given = step.own_rules
    if given:
        for name in sorted(own - step.rules.logical_names - given.generic):
            missing.setdefault(name, []).append("a with_sharding_constraint")
    out = []
    known = {n for n, _ in given} | set(step.mesh.axis_names)
    for name, where in missing.items():
        shown = ", ".join(repr(p) for p in where[:4]) + (f", ... ({len(where)} in all)" if len(where) > 4 else "")
        out.append(f"logical name {name!r} has no rule{_hint(name, known)}, so it is replicated on {shown}; "
                   f"add ({name!r}, <mesh axes>) to the rules to shard it, or ({name!r}, None) to say it stays "
                   f"replicated")
    if constraints is not None:
        # a rule to None that matches nothing is harmless (it says "whole", for a name that is not there)
        for name in dict.fromkeys(n for n, a in given if a is not None and n not in used and n not in given.generic):
            out.append(f"the rule for logical name {name!r} matches nothing: no parameter, batch leaf or constraint "
                       f"of the step names {name!r}{_hint(name, used)}; fix its spelling or drop it")
    return out


def warn_rule_coverage(messages: Iterable[str], *, stacklevel: int = 2) -> None:
    for message in messages:
        warnings.warn(f"parallelize: {message}", stacklevel=stacklevel + 1)
