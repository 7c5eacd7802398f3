"""Zero-bubble pipelines: each backward unit split into input gradient (B) and weight gradient (W).

A stage's backward pass computes two things: the cotangent of its input,
which the previous stage waits for (the critical path), and the gradients
of its own parameters, which nothing else waits for until the optimizer.
Zero-bubble schedules run the first as ``B`` and defer the second, ``W``, into
the bubbles.

The split is a dependency cut of the unit's equations: ``B`` is every
equation the values read by *other* submeshes depend on, ``W`` the rest (it
reads ``B``'s intermediate results on the same submesh, so nothing is
computed twice). A task's backward is one `task_call` equation, so its body
is inlined first (`inline_backward_tasks`), each equation keeping the task's
placement. The first stage has no cotangent to send: its ``B`` is empty and
it runs ``W`` alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend.core import DropVar, Literal, Var

from ..schedules import WEIGHT, Schedule
from ..trace.task import Placement, task_call_p
from .segment import Segment

__all__ = ["inline_backward_tasks", "split_backward"]


def inline_backward_tasks(eqns: Sequence[Any], consts: dict[Var, Any]
                          ) -> tuple[list, dict[Var, Any], dict[int, Placement]]:
    """Replace every backward `task_call` by its body.

    Returns the equations, the constants (the bodies' own added), and the
    placement of each inlined equation (by ``id``): it is the task's, not
    something for the partitioner to guess.
    """
    out: list = []
    consts = dict(consts)
    placed: dict[int, Placement] = {}
    for e in eqns:
        if e.primitive is not task_call_p or e.params["kind"] != "bwd":
            out.append(e)
            continue
        body = e.params["jaxpr"].jaxpr
        made = {v for inner in body.eqns for v in inner.outvars}
        result: dict[Var, Var] = {}  # a body result computed by the body is written to the call's output
        for v, w in zip(body.outvars, e.outvars):
            if isinstance(w, DropVar):
                continue
            if isinstance(v, Literal) or v not in made or v in result:
                raise NotImplementedError(
                    f"task {e.params['placement'].name!r}: its backward returns an input, a constant or one "
                    f"value twice, which a zero-bubble schedule cannot split yet; use schedule='1f1b'")
            result[v] = w
        env: dict[Var, Any] = dict(zip(body.invars, e.invars))
        for v, c in zip(body.constvars, e.params["jaxpr"].consts):
            env[v] = Var(v.aval)
            consts[env[v]] = c
        for inner in body.eqns:
            outs = [result.get(v) or Var(v.aval) for v in inner.outvars]
            env.update(zip(inner.outvars, outs))
            copy = inner.replace(invars=[x if isinstance(x, Literal) else env[x] for x in inner.invars],
                                 outvars=outs, source_info=e.source_info)  # the call's scopes: microbatch, backward
            placed[id(copy)] = e.params["placement"]
            out.append(copy)
    return out, consts, placed


def split_backward(segments: list[Segment], schedule: Schedule) -> list[Segment]:
    """Each backward unit as its ``B`` then its ``W`` segment (an empty one is left out)."""
    readers: dict[Var, set] = {}
    for s in segments:
        for e in s.eqns:
            for v in e.invars:
                if not isinstance(v, Literal):
                    readers.setdefault(v, set()).add(s.placement)
    out: list[Segment] = []
    for seg in segments:
        if seg.action is None or seg.action.kind != "B":
            out.append(seg)
            continue
        needed = {v for e in seg.eqns for v in e.outvars if readers.get(v, {seg.placement}) - {seg.placement}}
        critical = [False] * len(seg.eqns)
        for k in reversed(range(len(seg.eqns))):
            e = seg.eqns[k]
            if any(v in needed for v in e.outvars):
                critical[k] = True
                needed.update(v for v in e.invars if not isinstance(v, Literal))
        weight = schedule.action(seg.action.stage, seg.action.microbatch, WEIGHT)
        for eqns, action in (([e for e, c in zip(seg.eqns, critical) if c], seg.action),
                             ([e for e, c in zip(seg.eqns, critical) if not c], weight)):
            if eqns:
                out.append(Segment(seg.index, seg.placement, eqns, unit=seg.unit, action=action, stage=seg.stage))
    for k, s in enumerate(out):
        s.index = k
    return out
