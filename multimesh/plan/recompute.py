"""Recompute instead of transfer: values made from constants and small inputs are computed where read.

A causal mask, position ids, ``zeros`` or ``arange`` built in a step's glue
is placed with its first consumer; every other submesh that reads it would
receive a copy. When the value depends on literals only (through cheap,
effect-free equations), each submesh that reads it computes its own copy
instead: the transfer disappears, and the original is dropped when nothing
else reads it. MultiMesh calls this "communication-avoiding recompute of
inter-task intermediates" (`enable_recomputation`, on by default).

Small step inputs (at most `SMALL_INPUT_BYTES`: a step counter, a learning
rate) count as constants too, in glue (what no task or registered scope
placed): a submesh that recomputes from one receives the input itself. An
optimizer's per-step scalars (Adam's bias corrections, a schedule's learning
rate, all from the step count) are then computed on every stage from one copy
of the count, instead of on one stage and sent to each other stage one by
one, which also split each other stage's update in two.

Not recomputed: equations with effects, with nested jaxprs, or whose cost is
not proportional to their output (``dot_general``, convolutions, FFTs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend.core import Literal, Var

from .segment import nbytes

__all__ = ["SMALL_INPUT_BYTES", "recompute_constants"]

#: Step inputs up to this size are recomputed from like constants (each reading submesh gets a copy).
SMALL_INPUT_BYTES = 64

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
                        outputs: Sequence[Any], inputs: Sequence[Var] = (),
                        pinned: Sequence[bool] | None = None) -> tuple[list, list, list, set[int]]:
    """``(eqns, colour, units, copies)``: values made from literals and small ``inputs`` alone, read on
    another placement, are recomputed there.

    A copy is inserted just before its first reader on that placement, with the
    reader's scope (so it belongs to the reader's microbatch) and unit;
    ``copies`` holds the ``id`` of every copy. An equation the user placed
    (``pinned``: in a task or a registered scope) is recomputed from literals
    only, never from inputs: it stays where it was put.
    """
    small = {v for v in inputs if nbytes(v) <= SMALL_INPUT_BYTES}
    made_from_literals: dict[Var, int] = {}
    from_inputs: set[Var] = set()  # those of them that read a small input
    cheap: dict[tuple[int, Any], bool] = {}  # by parameters: a microbatch's copies of an equation share them
    for i, e in enumerate(eqns):
        for v in e.invars:  # most equations read a value of neither kind: that is asked first
            if not (isinstance(v, Literal) or v in small or v in made_from_literals):
                break
        else:
            known = cheap.get((id(e.params), e.primitive))
            if known is None:
                known = cheap[(id(e.params), e.primitive)] = _cheap(e)
            if not known:
                continue
            reads_input = any(v in small or v in from_inputs for v in e.invars if not isinstance(v, Literal))
            if reads_input and pinned is not None and pinned[i]:
                continue
            for v in e.outvars:
                made_from_literals[v] = i
                if reads_input:
                    from_inputs.add(v)
    if not made_from_literals:
        return list(eqns), list(colour), list(units), set()

    new_eqns: list = []
    new_colour: list = []
    new_units: list = []
    copies: dict[tuple[Var, Any], Var] = {}
    made: set[int] = set()  # ids of the copies

    def here(v: Var, c: Any, reader: Any, unit: Any) -> Var:
        """``v`` computed on placement ``c`` (a copy made on demand, its inputs first; a small input as is)."""
        if v not in made_from_literals:
            return v
        k = made_from_literals[v]
        if colour[k] == c:
            return v
        if (v, c) not in copies:
            e = eqns[k]
            ins = [x if isinstance(x, Literal) else here(x, c, reader, unit) for x in e.invars]
            outs = [Var(o.aval) for o in e.outvars]
            new_eqns.append(e.replace(invars=ins, outvars=outs, source_info=reader.source_info))
            made.add(id(new_eqns[-1]))
            new_colour.append(c)
            new_units.append(unit)
            copies.update(((o, c), n) for o, n in zip(e.outvars, outs))
        return copies[(v, c)]

    for i, e in enumerate(eqns):
        c = colour[i]
        elsewhere = {v for v in e.invars if not isinstance(v, Literal) and v in made_from_literals
                     and colour[made_from_literals[v]] != c}
        if elsewhere:  # most equations read none
            e = e.replace(invars=[here(v, c, e, units[i]) if not isinstance(v, Literal) and v in elsewhere else v
                                  for v in e.invars])
        new_eqns.append(e)
        new_colour.append(c)
        new_units.append(units[i])

    # Originals that nothing reads any more (every reader has its own copy) are dropped; only the reads of
    # their outputs matter.
    theirs = made_from_literals.keys()
    read = {v for v in outputs if not isinstance(v, Literal) and v in theirs}
    keep = [True] * len(new_eqns)
    originals = {id(eqns[k]) for k in set(made_from_literals.values())}
    for j in reversed(range(len(new_eqns))):
        e = new_eqns[j]
        if id(e) in originals and read.isdisjoint(e.outvars):
            keep[j] = False
            continue
        read.update(v for v in e.invars if not isinstance(v, Literal) and v in theirs)
    pick = [j for j in range(len(new_eqns)) if keep[j]]
    return ([new_eqns[j] for j in pick], [new_colour[j] for j in pick], [new_units[j] for j in pick], made)
