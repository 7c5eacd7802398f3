"""Order a plan's segments by a pipeline schedule.

Each segment holding pipeline work (a `Unit`: microbatch m, forward or
backward, logical stage l) becomes the schedule's `Action` (l, m, F|B), and
its rank in ``schedule.order`` is its priority. Glue segments take the
priority of their earliest pipeline consumer (they run just before it) or,
with none, of their latest pipeline producer: just after it when the glue
belongs to a microbatch (adding its gradient to the sum, which `microbatch`
and reverse mode do inside the microbatch's scope), else after the whole
schedule (the optimizer update). A list
scheduler then runs, at every step, the ready segment of lowest priority, so
the executed order is the schedule's wherever the data dependencies allow it
(tests check that it is exactly the schedule's).

Finally, glue inside a microbatch is fused with a unit of that microbatch on
the same submesh into one `jax.jit`: fewer dispatches, each unit still starts
as soon as its predecessor on another stage is done, and every microbatch's
units stay one program (see `_fuse`).
"""

from __future__ import annotations

import bisect
import heapq
import math
import re
from collections.abc import Sequence
from typing import Any

from jax.extend.core import Literal

from ..schedules import Schedule
from ..trace.implicit import microbatch_of, placed_by
from ..trace.microbatch import Pipeline
from ..trace.task import Placement
from .segment import Segment
from .split import split_backward

__all__ = ["schedule_segments", "stage_layout"]


def stage_layout(segments: Sequence[Segment]) -> tuple[list[Placement], int]:
    """The placement of each logical stage (from microbatch 0's forward), and the microbatch count."""
    runs: dict[int, dict[int, Placement]] = {}
    for seg in segments:
        u = seg.unit
        if u is not None and not u.backward:
            runs.setdefault(u.microbatch, {})[u.run] = seg.placement
    if not runs:
        return [], 0
    first = runs[min(runs)]
    logical = [first[r] for r in sorted(first)]
    for m, seq in runs.items():
        if [seq[r] for r in sorted(seq)] != logical:
            raise ValueError(
                f"microbatch {m} passes through stages {[p.name for p in seq.values()]}, but microbatch "
                f"{min(runs)} through {[p.name for p in logical]}: every microbatch must take the same path"
            )
    return logical, len(runs)


def _schedule_for(segments: Sequence[Segment], pipelines: Sequence[Pipeline]) -> Schedule | None:
    specs = list(dict.fromkeys(pipelines))  # each microbatch call once (`Pipeline.call` tells calls apart)
    if len(specs) > 1:  # before the paths: two pipelines' microbatches share indices, so their paths mix
        raise ValueError(f"one step may hold one microbatch pipeline, found {len(specs)}: "
                         f"{', '.join(f'microbatch({s.name})' for s in specs)}; microbatch one function that "
                         f"computes everything the step needs per microbatch (e.g. both losses, summed or in a "
                         f"tuple), or run the pipelines as separate steps")
    logical, n_mb = stage_layout(segments)
    if not specs or not logical:
        return None
    spec = specs[0]
    groups = list(dict.fromkeys(logical))
    names = " -> ".join(str(p.name) for p in logical)
    if len(logical) % len(groups) or any(logical[l] is not groups[l % len(groups)] for l in range(len(logical))):
        raise ValueError(
            f"microbatch({spec.name}): the tasks form the stage sequence {names}; a pipeline needs each "
            f"submesh once per microbatch, or (interleaved) the same cycle of submeshes repeated. "
            + _revisit_advice(segments, logical)
        )
    chunks = len(logical) // len(groups)
    if chunks > 1 and spec.interleave != chunks:
        raise ValueError(
            f"microbatch({spec.name}): the stage sequence {names} visits each of {len(groups)} submeshes "
            f"{chunks} times; use schedule='interleaved' with interleave={chunks}"
        )
    if chunks == 1 and spec.num_chunks > 1:  # the schedule would order logical stages the tasks do not form
        cycle = " -> ".join([str(p.name) for p in groups] * spec.num_chunks)
        raise ValueError(
            f"microbatch({spec.name}): schedule={spec.schedule_name!r} runs {spec.num_chunks} chunks "
            f"(interleave={spec.num_chunks}) on each submesh, but the stage sequence {names} visits each "
            f"submesh once; call each stage's task {spec.num_chunks} times per microbatch, cycling "
            f"({cycle}), or use schedule='1f1b'"
        )
    if spec.num_microbatches != n_mb:
        raise ValueError(f"microbatch({spec.name}): {spec.num_microbatches} microbatches were traced, "
                         f"but tasks ran in {n_mb}")
    backward = any(s.unit is not None and s.unit.backward for s in segments)
    schedule = spec.build(len(groups), forward_only=not backward)
    stage_of = {p: i for i, p in enumerate(groups)}
    for seg in segments:
        u = seg.unit
        if u is None:
            continue
        logical_stage = len(logical) - 1 - u.run if u.backward else u.run
        if not 0 <= logical_stage < len(logical) or logical[logical_stage] is not seg.placement:
            raise ValueError(
                f"the backward pass of microbatch {u.microbatch} runs on {seg.placement.name} where the "
                f"forward pass has no matching stage (stages: {names})"
            )
        seg.action = schedule.action(logical_stage, u.microbatch, "B" if u.backward else "F")
        seg.stage = stage_of[seg.placement]
    return schedule


def _revisit_advice(segments: Sequence[Segment], logical: Sequence[Placement]) -> str:
    """What to register where, when microbatch 0's forward comes back to a stage it left: the scope names
    (Linen's or NNX's, as this step has them) that placed the return there, and the last stage's pattern
    with them added."""
    back = next(r for r in range(1, len(logical)) if any(p is logical[r] for p in logical[:r]))
    first = next(r for r in range(back) if logical[r] is logical[back])
    microbatch = min(s.unit.microbatch for s in segments if s.unit is not None)

    def placing(run: int) -> dict[str, Any]:
        """Scope name -> the registration whose match of it placed microbatch 0's forward of ``run``."""
        found: dict[str, Any] = {}
        for seg in segments:
            u = seg.unit
            if u is not None and u.microbatch == microbatch and not u.backward and u.run == run:
                for e in seg.eqns:
                    if (hit := placed_by(e.source_info.name_stack)) is not None:
                        found.setdefault(*hit)
        return found

    again, before = placing(back), placing(first)
    own = [n for n in again if n not in before]
    where = f"Stage {logical[back].name} runs again after {logical[back - 1].name}"
    if not own:
        shown = ", ".join(repr(n) for n in list(again)[:4]) or "no registered name"
        return (f"{where} for equations under {shown}, the names its first visit runs under too: give the "
                f"second use a name of its own (a method other than __call__ runs under 'module.method', Linen's "
                f"and NNX's alike; or a jax.named_scope) and register that name with the last stage")
    shown = ", ".join(repr(n) for n in own[:4]) + (f" ({len(own)} names)" if len(own) > 4 else "")
    matched = dict.fromkeys(reg.pattern.pattern for n in own if (reg := again[n]) is not None)
    calls = " and ".join(f"register_task(r'{p}')" for p in matched)
    by = f" (matched by {calls})" if calls else ""
    last = dict.fromkeys(reg.pattern.pattern for reg in placing(back - 1).values() if reg is not None)
    example = "|".join([*last, *(re.escape(n) for n in own[:4])])
    return (f"{where} for the equations under {shown}{by}. A weight used at both ends (a tied embedding's "
            f"lookup and logits) need not be on one stage: register its second use with the last stage, e.g. "
            f"register_task(r'{example}', ...); the table is then read on both and its gradient summed")


def _priorities(segments: Sequence[Segment], schedule: Schedule) -> tuple[list[float], list[set[int]]]:
    rank = {a: i for i, a in enumerate(schedule.order)}
    producer = {v: s.index for s in segments for e in s.eqns for v in e.outvars}
    deps = [{producer[v] for e in s.eqns for v in e.invars
             if not isinstance(v, Literal) and v in producer and producer[v] != s.index} for s in segments]
    own = [rank[s.action] if s.action is not None else None for s in segments]
    down = [math.inf] * len(segments)  # earliest pipeline consumer
    for s in reversed(segments):
        mine = own[s.index]
        for d in deps[s.index]:
            down[d] = min(down[d], mine if mine is not None else down[s.index])
    up = [-math.inf] * len(segments)  # latest pipeline producer
    for s in segments:
        for d in deps[s.index]:
            theirs = own[d]
            up[s.index] = max(up[s.index], theirs if theirs is not None else up[d])
    out = []
    for i in range(len(segments)):
        if (mine := own[i]) is not None:
            out.append(float(mine))
        elif down[i] < math.inf:
            out.append(down[i] - 0.5)
        elif up[i] > -math.inf:  # right after its producer inside a microbatch, else after the schedule
            out.append(up[i] + 0.5 + (len(rank) if _microbatch(segments[i]) is None else 0))
        else:
            out.append(-1.0)
    return out, deps


def _list_schedule(segments: Sequence[Segment], priority: Sequence[float], deps: Sequence[set]) -> list[Segment]:
    waiting = [len(d) for d in deps]
    users: list[list[int]] = [[] for _ in segments]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    ready = [(priority[i], i) for i in range(len(segments)) if waiting[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(segments[i])
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (priority[u], u))
    return order


def _microbatch(seg: Segment) -> int | None:
    if seg.unit is not None:
        return seg.unit.microbatch
    found = {microbatch_of(e.source_info.name_stack) for e in seg.eqns}
    return found.pop() if len(found) == 1 else None


def _fuse(order: Sequence[Segment]) -> list[Segment]:
    """Merge glue into units: fewer dispatches, while every microbatch's units stay one program.

    Glue inside a microbatch (its slicing, its loss) joins the next segment on
    its submesh when that is a unit of its microbatch and nothing in between
    reads its results, else the previous one when that is such a unit and
    nothing in between writes its inputs. What is left, and glue outside the
    microbatches (the optimizer update), joins the glue just before it on its
    submesh when it has the same microbatch. Glue outside the microbatches
    never joins a unit: there it would make the first or the last microbatch's
    program differ from the others' (`programs.group_programs`).
    """
    out = [Segment(s.index, s.placement, list(s.eqns), unit=s.unit, action=s.action, stage=s.stage) for s in order]
    made = [{v for e in s.eqns for v in e.outvars} for s in out]
    read = [{v for e in s.eqns for v in e.invars if not isinstance(v, Literal)} for s in out]
    mb = [_microbatch(s) for s in out]
    gone = [False] * len(out)
    # each submesh's segments and units of work, in order: a neighbour is found without walking the others'
    on: dict[tuple[Placement, bool], list[int]] = {}
    for k, s in enumerate(out):
        on.setdefault((s.placement, False), []).append(k)
        if s.action is not None:
            on.setdefault((s.placement, True), []).append(k)

    def neighbour(i: int, step: int, unit: bool = False) -> int | None:
        """The next (step 1) or previous (-1) segment on ``i``'s submesh; with ``unit``, unit of work."""
        mine = on.get((out[i].placement, unit), [])
        at = bisect.bisect_right(mine, i) if step > 0 else bisect.bisect_left(mine, i) - 1
        while 0 <= at < len(mine) and gone[mine[at]]:  # glue merged away (units never are)
            at += step
        return mine[at] if 0 <= at < len(mine) else None

    def merge(i: int, j: int) -> None:
        """Glue ``i`` into segment ``j``, keeping program order inside it."""
        if j > i:
            out[j].eqns[:0] = out[i].eqns
        else:
            out[j].eqns.extend(out[i].eqns)
        read[j] |= read[i]
        made[j] |= made[i]
        read[i], made[i], gone[i] = set(), set(), True

    def joins(i: int, j: int) -> bool:
        """Whether glue ``i`` may join segment ``j``: a unit of its microbatch, or glue of the same one."""
        unit = out[j].unit
        if out[j].action is None:
            return mb[j] == mb[i]
        if unit is None:
            raise AssertionError(f"segment {out[j]} has a schedule action but no unit of work")
        return mb[i] is not None and unit.microbatch == mb[i]

    def later_ok(i: int, j: int) -> bool:  # nothing between reads what i makes
        return not any(read[k] & made[i] for k in range(i + 1, j))

    def earlier_ok(i: int, j: int) -> bool:  # nothing between makes what i reads
        return not any(made[k] & read[i] for k in range(j + 1, i))

    glue = [i for i, s in enumerate(out) if s.action is None]
    for i in reversed(glue):
        if mb[i] is not None and (j := neighbour(i, 1, unit=True)) is not None and joins(i, j) and later_ok(i, j):
            merge(i, j)
    for i in glue:
        if gone[i]:
            continue
        j = neighbour(i, -1, unit=True) if mb[i] is not None else None
        if j is None or not (joins(i, j) and earlier_ok(i, j)):
            j = neighbour(i, -1)
        if j is not None and joins(i, j) and earlier_ok(i, j):
            merge(i, j)
    return [s for s, g in zip(out, gone) if not g]


def schedule_segments(segments: list[Segment], pipelines: Sequence[Pipeline]) -> tuple[list[Segment], Schedule | None]:
    """``segments`` in the order of the step's pipeline schedule (unchanged without one)."""
    schedule = _schedule_for(segments, pipelines)
    if schedule is None:
        return segments, None
    if schedule.split_backward:
        segments = split_backward(segments, schedule)
    priority, deps = _priorities(segments, schedule)
    return _fuse(_list_schedule(segments, priority, deps)), schedule

