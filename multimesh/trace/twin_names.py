"""Name a module copy that could be any of several twins by the parameters that flow into it.

JAX's own transforms (``jax.checkpoint``, ``jax.lax.scan``; NNX's in tree mode,
which are built on them) hand their body a copy of an NNX module that JAX's
unflattening rebuilt, linked to nothing. `nnx_scopes` names such a copy by
the one model module it is a pytree twin of; where several are (blocks of one
structure in a loop, each under ``jax.checkpoint``), it names it with a
placeholder scope and records the candidates. Once the step is traced, the
data says which: the copy's equations read the body's inputs, and those are
the transform's operands, the model's own parameters among them, whose
paths in the step's arguments are known. `name_twins` follows each parameter from the step's
inputs into the nested jaxprs (a jit's, a remat's, a scan's body: operands
one for one), and where the equations under a placeholder read parameters of
exactly one candidate (its path in the step's arguments contains the
candidate's), renames the placeholder (and its submodules' scopes) to that
candidate's path. The backward of a rematerialised copy reads the same
parameters and is named alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var

from .implicit import scope_names
from .input_paths import NameStackWalk, renamed_scopes

__all__ = ["name_twins"]


def _placeholder_of(name: str, placeholders: Mapping[str, Sequence[str]]) -> str | None:
    """The placeholder ``name`` is (``multimesh-twin-0``) or is a submodule scope of (``multimesh-twin-0.mlp``),
    or None."""
    head = name.split(".", 1)[0]
    return head if head in placeholders else None


def name_twins(closed: ClosedJaxpr, paths: Mapping[Var, str],
               placeholders: Mapping[str, Sequence[str]]) -> tuple[ClosedJaxpr, dict[str, Sequence[str]]]:
    """``closed`` with each placeholder scope renamed to the one candidate whose parameters its equations read.

    ``paths``: for the step's inputs (its jaxpr's variables), their path in the step's arguments
    (``0.blocks.1.mlp.up.kernel.value``: a candidate's parameters are under it, and its optimizer moments);
    ``placeholders``: placeholder scope -> candidate module paths. Returns the renamed jaxpr (a placeholder
    the data does not name is dropped: its equations keep their caller's scope) and the placeholders named
    nowhere.
    """
    walk = _Walk(placeholders)
    renamed = walk.rewrite(closed, paths)
    return renamed, {k: placeholders[k] for k in sorted(walk.seen - walk.named)}


class _Walk(NameStackWalk):
    def __init__(self, placeholders: Mapping[str, Sequence[str]]):
        self.placeholders = placeholders
        self.seen: set[str] = set()
        self.named: set[str] = set()  # placeholders renamed somewhere (elsewhere, an equation may read none)

    def enter(self, jaxpr: Jaxpr, paths: Mapping[Var, str], outer: Mapping[str, str] | None) -> dict[str, str]:
        """The placeholders chosen outside, and here (a body JAX traced once and called on each twin is renamed
        per call: its copies differ)."""
        return {**(outer or {}), **self._choose(jaxpr, paths)}

    def _choose(self, jaxpr: Jaxpr, paths: Mapping[Var, str]) -> dict[str, str]:
        """Placeholder -> the one candidate whose parameters the equations under it read here."""
        read: dict[str, set[str]] = {}
        for eqn in jaxpr.eqns:
            for scope in scope_names(eqn.source_info.name_stack):
                if (k := _placeholder_of(scope, self.placeholders)) is not None:
                    read.setdefault(k, set()).update(
                        paths[v] for v in eqn.invars if isinstance(v, Var) and v in paths)
        chosen = {}
        for k, modules in read.items():
            hits = [c for c in self.placeholders[k] if any(f".{c}." in f".{m}." for m in modules)]
            if len(hits) == 1:
                chosen[k] = hits[0]
        return chosen

    def name_stack(self, eqn: JaxprEqn, reads: Sequence[str], chosen: Mapping[str, str]) -> Any:
        return renamed_scopes(eqn.source_info.name_stack, lambda name: self._renamed(name, chosen))

    def _renamed(self, name: str, chosen: Mapping[str, str]) -> str | None:
        """``name`` renamed to its candidate's path; None (dropped: the caller's scope) for a placeholder the
        data does not name here."""
        if (k := _placeholder_of(name, self.placeholders)) is None:
            return name
        self.seen.add(k)
        if k not in chosen:
            return None
        self.named.add(k)
        return chosen[k] + name[len(k):]
