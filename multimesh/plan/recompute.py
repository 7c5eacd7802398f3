"""Recompute instead of transfer: values made from constants alone are computed where they are read.

A causal mask, position ids, ``zeros`` or ``arange`` built in a step's glue
is placed with its first consumer; every other submesh that reads it would
receive a copy. When the value depends on literals only (through cheap,
effect-free equations), each submesh that reads it computes its own copy
instead: the transfer disappears, and the original is dropped when nothing
else reads it. MultiMesh calls this "communication-avoiding recompute of
inter-task intermediates" (`enable_recomputation`, on by default).

Not recomputed: equations with effects, with nested jaxprs, or whose cost is
not proportional to their output (``dot_general``, convolutions, FFTs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend.core import Literal, Var

__all__ = ["recompute_constants"]

_COSTLY = frozenset({"dot_general", "conv_general_dilated", "fft", "custom_call", "while", "scan", "cond",
                     "reduce_window", "select_and_scatter_add", "sort", "cumsum", "cumprod", "cummax", "cumlogsumexp"})


def _cheap(eqn: Any) -> bool:
    if eqn.effects or eqn.primitive.name in _COSTLY:
        return False
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                return False
    return True


def recompute_constants(eqns: Sequence[Any], colour: Sequence[Any], units: Sequence[Any],
                        outputs: Sequence[Any]) -> tuple[list, list, list, int]:
    """``(eqns, colour, units, n)``: constant-only values read on another placement are recomputed there.

    A copy is inserted just before its first reader on that placement, with the
    reader's scope (so it belongs to the reader's microbatch) and unit; ``n``
    counts the copies.
    """
    made_from_literals: dict[Var, int] = {}
    for i, e in enumerate(eqns):
        if _cheap(e) and all(isinstance(v, Literal) or v in made_from_literals for v in e.invars):
            for v in e.outvars:
                made_from_literals[v] = i
    if not made_from_literals:
        return list(eqns), list(colour), list(units), 0

    new_eqns: list = []
    new_colour: list = []
    new_units: list = []
    copies: dict[tuple[Var, Any], Var] = {}

    def here(v: Var, c: Any, reader: Any, unit: Any) -> Var:
        """``v`` computed on placement ``c`` (a copy made on demand, its inputs first)."""
        k = made_from_literals[v]
        if colour[k] == c:
            return v
        if (v, c) not in copies:
            e = eqns[k]
            ins = [x if isinstance(x, Literal) else here(x, c, reader, unit) for x in e.invars]
            outs = [Var(o.aval) for o in e.outvars]
            new_eqns.append(e.replace(invars=ins, outvars=outs, source_info=reader.source_info))
            new_colour.append(c)
            new_units.append(unit)
            copies.update(((o, c), n) for o, n in zip(e.outvars, outs))
        return copies[(v, c)]

    for i, e in enumerate(eqns):
        c = colour[i]
        ins = [here(v, c, e, units[i]) if not isinstance(v, Literal) and v in made_from_literals
               and colour[made_from_literals[v]] != c else v for v in e.invars]
        new_eqns.append(e if all(a is b for a, b in zip(ins, e.invars)) else e.replace(invars=ins))
        new_colour.append(c)
        new_units.append(units[i])

    # Originals that nothing reads any more (every reader has its own copy) are dropped.
    read = {v for v in outputs if not isinstance(v, Literal)}
    keep = [True] * len(new_eqns)
    originals = {id(eqns[k]) for k in set(made_from_literals.values())}
    for j in reversed(range(len(new_eqns))):
        e = new_eqns[j]
        if id(e) in originals and not any(v in read for v in e.outvars):
            keep[j] = False
            continue
        read.update(v for v in e.invars if not isinstance(v, Literal))
    pick = [j for j in range(len(new_eqns)) if keep[j]]
    return ([new_eqns[j] for j in pick], [new_colour[j] for j in pick], [new_units[j] for j in pick],
            len(copies))
