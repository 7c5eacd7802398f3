"""Partition a traced step into per-submesh segments: the MPMD plan.

Every equation gets a placement ("colour"): a task call its own, an equation
inside a registered implicit task (by its scope stack) that task's; any other
equation the placement of the first coloured equation that consumes its
result (glue runs where its result is needed), else that of the producer of
its largest coloured input (the optimizer update of a stage's parameters runs
on that stage), repeated until nothing changes.

Under `microbatch`, coloured equations also carry a *unit*: their microbatch,
forward or backward, and which run of consecutive stages they belong to (the
logical stage). Equations are grouped, in program order, into segments: an
equation joins the latest segment of its placement and unit (glue: the latest
glue segment of its placement) unless one of its inputs comes from a later
segment, in which case it opens a new one. Segment order is then a valid
execution order; with a pipeline, `order.schedule_segments` reorders the
segments to follow the schedule.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, Var

from ..core.fmt import format_bytes
from ..core.gc_pause import without_gc
from ..schedules import Schedule
from ..trace.implicit import implicit_placement, pass_of
from ..trace.knobs import current_knobs
from ..trace.microbatch import Pipeline
from ..trace.task import Placement, task_call_p
from ..trace.taskspec import split_names
from .loop_slices import floating, place_per_microbatch
from .order import schedule_segments
from .recompute import recompute_constants
from .scan_split import check_split_registrations, is_split_scan, split_scans, warn_whole_stacks
from .segment import Segment, Unit, nbytes
from .split import inline_backward_tasks
from .stack_layout import Boundary

__all__ = ["Plan", "has_tasks", "inline_calls", "make_plan", "partition"]


def has_tasks(jaxpr: Jaxpr) -> bool:
    """Whether any task is called (or an implicit one matched), at the top level or inside nested calls."""
    for e in jaxpr.eqns:
        if e.primitive is task_call_p or implicit_placement(e.source_info.name_stack) is not None \
                or is_split_scan(e):
            return True
        for value in e.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, Jaxpr) and has_tasks(inner):
                return True
    return False


@dataclass
class Plan:
    """Segments in execution order, where each step input goes, and the outputs."""

    jaxpr: Jaxpr
    segments: list[Segment]
    input_placement: dict[Var, Placement]
    producer: dict[Var, int]
    consts: dict[Var, Any]
    schedule: Schedule | None = None
    #: a split scanned stack (`scan_split`): which step inputs and outputs ``jaxpr`` takes and returns in parts
    boundary: Boundary | None = None
    #: the step's own jaxpr (its inputs and outputs are the step's): as traced, nested calls not inlined (a
    #: microbatch's body once, not once per microbatch), for the checks that read the step's scopes and constraints
    step_jaxpr: Jaxpr | None = None

    def step_input_placement(self, i: int) -> Placement:
        """Where step input ``i`` lives: where it is first read (a split stack's: its first part's stage),
        unless kept elsewhere (`keep_inputs_on`)."""
        return self.input_placement.get(self._step_invar(i), self.placements[0])

    def keep_inputs_on(self, indices: Iterable[int], where: Placement) -> None:
        """Step inputs ``indices`` live on ``where``, not where first read: reading them elsewhere is a
        transfer (`transfers`)."""
        for i in indices:
            self.input_placement[self._step_invar(i)] = where

    def _step_invar(self, i: int) -> Var:
        return self.jaxpr.invars[i if self.boundary is None else self.boundary.plan_index(i)]

    @property
    def placements(self) -> list[Placement]:
        return list(dict.fromkeys(s.placement for s in self.segments))

    def transfers(self) -> list[tuple[str, int, int, Any, int]]:
        """(what, from segment or -1 for an input, to segment, aval, bytes) for every value crossing submeshes:
        once per submesh, to the first segment there that reads it (later ones read that copy)."""
        out, moved = [], set()
        for seg in self.segments:
            for v in seg.invars:
                src = self.producer.get(v)
                where = self.segments[src].placement if src is not None else self.input_placement.get(v)
                if where is not None and where.devices != seg.placement.devices \
                        and (v, seg.placement.devices) not in moved:
                    moved.add((v, seg.placement.devices))
                    out.append((str(v), -1 if src is None else src, seg.index, v.aval, nbytes(v)))
        return out

    def stage_names(self) -> list[str] | None:
        """The name of each physical stage of the schedule (its tasks' names, a device group's several
        joined by ``,``), or None without a schedule: ``plot_schedule(plan.schedule, path,
        stage_names=plan.stage_names())`` draws them."""
        if self.schedule is None:
            return None
        names: dict[int, list[str]] = {s: [] for s in range(self.schedule.num_stages)}
        for seg in self.segments:
            if seg.action is not None:
                names[self.schedule.physical_stage(seg.action)].append(str(seg.placement.name))
        return [",".join(dict.fromkeys(names[s])) or "?" for s in range(self.schedule.num_stages)]

    def __repr__(self) -> str:
        stages = ", ".join(p.name or "default" for p in self.placements)
        schedule = f", {self.schedule!r}" if self.schedule is not None else ""
        moved = sum(t[4] for t in self.transfers())
        return (f"Plan({len(self.segments)} segments on [{stages}]{schedule}, {format_bytes(moved)} resharded per "
                f"step; print it for the table)")

    def __str__(self) -> str:
        lines = [f"MPMD plan: {len(self.segments)} segments on {len(self.placements)} submeshes"]
        for p in self.placements:
            lines.append(f"  submesh {p.describe()}")
        moves: dict[int, list] = {}
        for what, src, dst, aval, size in self.transfers():
            moves.setdefault(dst, []).append((src, aval, size))
        # Indices and labels padded to the widest, so that the columns stay aligned past [9].
        index_width = max((len(f"[{seg.index}]") for seg in self.segments), default=3)
        label_width = max([28, *(len(seg.label) for seg in self.segments)])
        for seg in self.segments:
            n_in = sum(nbytes(v) for v in seg.invars)
            lines.append(
                f"  {f'[{seg.index}]':<{index_width}} {seg.label:<{label_width}} {len(seg.eqns):4d} eqns  "
                f"in {len(seg.invars)} ({_mib(n_in)})  out {len(seg.outvars)}"
            )
            lines.extend(_transfer_lines(moves.get(seg.index, []), indent=" " * (index_width + 5)))
        if self.boundary is not None:
            for split in dict.fromkeys(h.split for h in self.boundary.inputs + self.boundary.outputs if h is not None):
                lines.append(f"  split scan stack: {split.describe()}")
        total = sum(t[4] for t in self.transfers())
        lines.append(f"  total resharded per step: {_mib(total)}")
        if self.schedule is not None:
            lines.append(f"  schedule: {self.schedule!r}")
            lines.append("    " + ", ".join(f"stage {s}: {n}" for s, n in enumerate(self.stage_names() or ())))
            lines.extend("    " + row for row in self.schedule.render().splitlines())
        return "\n".join(lines)


def _transfer_lines(moves: Sequence[tuple[int, Any, int]], indent: str) -> list[str]:
    """One line per kind of transfer into a segment: identical ones (same type, origin and size; the
    scalars of an optimizer update, say) as one line with their count, in order of first appearance."""
    counts: dict[tuple[str, str, int], int] = {}
    for src, aval, size in moves:
        key = (aval.str_short(), "input" if src < 0 else f"[{src}]", size)
        counts[key] = counts.get(key, 0) + 1
    lines = []
    for (what, origin, size), n in counts.items():
        if n == 1:
            lines.append(f"{indent}<- reshard {what} from {origin} ({_mib(size)})")
        else:
            lines.append(f"{indent}<- {n} x reshard {what} from {origin} ({_mib(size)} each, {_mib(n * size)})")
    return lines


def _mib(n: int) -> str:
    return format_bytes(n, unit="MiB", digits=2, exact_below=2**16)


_INLINED = ("jit", "pjit", "closed_call")
_CUSTOM = ("custom_vjp_call", "custom_jvp_call")
_REMAT = ("checkpoint", "remat2")  # jax.checkpoint's primitive (its body: an open jaxpr)


def _inlined_body(eqn: Any, name_stack: Any) -> tuple[Jaxpr, Sequence] | None:
    """The body (jaxpr, consts) that inlining ``eqn`` puts in its place, or None to keep the equation."""
    if eqn.primitive.name in _INLINED and "jaxpr" in eqn.params:
        inner = eqn.params["jaxpr"]
        return inner.jaxpr, inner.consts
    if eqn.primitive.name in _CUSTOM and has_tasks(eqn.params["call_jaxpr"].jaxpr):
        # Not differentiated any further (the trace is final): its primal body is the program.
        inner = eqn.params["call_jaxpr"]
        return inner.jaxpr, inner.consts
    if eqn.primitive.name in _REMAT and _unplaced_around_tasks(eqn, name_stack):
        # A checkpoint outside every task around scopes that are tasks (`nnx.remat` of a block):
        # placed piece by piece; its recomputation stays on the block's stage (under `microbatch`,
        # in the backward's unit; without, the segment order may put it next to the forward).
        inner = eqn.params["jaxpr"]
        return getattr(inner, "jaxpr", inner), getattr(inner, "consts", ())
    return None


class _Inliner:
    """Copies a jaxpr's equations into one flat list, nested calls expanded in place.

    Equations are copied, not re-traced: each copy gets fresh output variables
    (a body called once per microbatch is copied once per call) and the scope
    stack of its call site followed by its own, so implicit tasks and
    microbatch indices survive inlining. A body's constants become constants
    of the flat program, once each.
    """

    def __init__(self) -> None:
        self.eqns: list = []
        self.constvars: list[Var] = []
        self.consts: list = []
        self._const_var: dict[int, Var] = {}
        # (outer stack, own stack) -> their concatenation (the outer one by identity: it stays alive in
        # ``_stacks``): the equations of one scope share one stack object, which `trace.implicit` reads once
        self._stacks: dict[tuple[int, Any], Any] = {}

    def stack(self, outer: Any, own: Any) -> Any:
        key = (id(outer), own)
        joined = self._stacks.get(key)
        if joined is None:
            joined = self._stacks[key] = outer + own
        return joined

    def const(self, value: Any, aval: Any) -> Var:
        v = self._const_var.get(id(value))
        if v is None:
            v = self._const_var[id(value)] = Var(aval)
            self.constvars.append(v)
            self.consts.append(value)
        return v

    def copy(self, jaxpr: Jaxpr, consts: Sequence, args: Sequence, outer_stack: Any) -> list:
        env: dict = {v: self.const(c, v.aval) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, args))

        def read(x: Any) -> Any:
            return x if isinstance(x, Literal) else env[x]

        for eqn in jaxpr.eqns:
            name_stack = self.stack(outer_stack, eqn.source_info.name_stack)
            ins = [read(x) for x in eqn.invars]
            body = _inlined_body(eqn, name_stack)
            if body is not None:
                env.update(zip(eqn.outvars, self.copy(body[0], body[1], ins, name_stack)))
                continue
            outs = [v if isinstance(v, DropVar) else Var(v.aval) for v in eqn.outvars]
            self.eqns.append(eqn.replace(invars=ins, outvars=outs,
                                         source_info=eqn.source_info.replace(name_stack=name_stack)))
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]


def _unplaced_around_tasks(eqn: Any, name_stack: Any) -> bool:
    inner = eqn.params.get("jaxpr")
    return (implicit_placement(name_stack) is None and inner is not None
            and has_tasks(getattr(inner, "jaxpr", inner)))


def inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same program with nested `jax.jit` calls flattened into the top level.

    A library's jitted helper (optax's tree-wide updates, say) may touch the
    parameters of every stage at once; inlined, each piece is placed alone.
    """
    jaxpr = closed.jaxpr
    inliner = _Inliner()
    outvars = inliner.copy(jaxpr, closed.consts, jaxpr.invars, source_info_util.new_name_stack())
    flat = Jaxpr(inliner.constvars, jaxpr.invars, outvars, inliner.eqns, jaxpr.effects, jaxpr.debug_info)
    return ClosedJaxpr(flat, inliner.consts)


def _implicit(eqns: Sequence) -> list[Placement | None]:
    """Each equation's implicit task's placement (by its scope stack), else None."""
    by_stack: dict[int, Placement | None] = {}  # inlined equations share stacks (`_Inliner.stack`), kept alive
    out = []
    for e in eqns:
        stack = e.source_info.name_stack
        if id(stack) not in by_stack:
            by_stack[id(stack)] = implicit_placement(stack)
        out.append(by_stack[id(stack)])
    return out


def _initial_colours(eqns: Sequence, implicit: Sequence[Placement | None],
                     placed: dict[int, Placement]) -> list[Placement | None]:
    """A task's placement, an inlined task body's (``placed``), an implicit task's (``implicit``), else None."""
    return [e.params["placement"] if e.primitive is task_call_p else placed.get(id(e)) or where
            for e, where in zip(eqns, implicit)]


def _units(eqns: Sequence, colour: Sequence[Placement | None]) -> list[Unit | None]:
    """The pipeline unit of each coloured equation inside a microbatch (None elsewhere, and on a task whose
    submesh changes with the microbatch: not a stage, its work runs as the microbatch's glue)."""
    units: list[Unit | None] = [None] * len(eqns)
    last: dict[tuple[int, bool], tuple[Placement, Unit]] = {}  # (microbatch, backward): its latest unit, where
    moving = floating(eqns, colour)
    for i, e in enumerate(eqns):
        here = colour[i]
        if here is None or here in moving:
            continue
        m, backward = pass_of(e.source_info.name_stack)
        if m is None:
            continue
        if e.primitive is task_call_p:
            backward = e.params["kind"] == "bwd"
        seen = last.get((m, backward))
        if seen is None or (seen[0] is not here and seen[0] != here):
            seen = last[(m, backward)] = (here, Unit(m, backward, 0 if seen is None else seen[1].run + 1))
        units[i] = seen[1]
    return units


def _propagate(eqns: Sequence, colour: list[Placement | None]) -> list[Placement]:
    """Glue's colour: its first coloured consumer's, else its largest coloured input's producer's."""
    consumers: dict[Var, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if not isinstance(v, Literal):
                consumers.setdefault(v, []).append(i)
    made_by: dict[Var, int] = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    changed = True
    while changed:
        changed = False
        for i in reversed(range(len(eqns))):
            if colour[i] is None:
                found = [colour[j] for v in eqns[i].outvars for j in consumers.get(v, ()) if colour[j] is not None]
                if found:
                    colour[i], changed = found[0], True
        for i, e in enumerate(eqns):
            if colour[i] is None:
                srcs = [(nbytes(v), colour[made_by[v]]) for v in e.invars
                        if not isinstance(v, Literal) and v in made_by and colour[made_by[v]] is not None]
                if srcs:
                    colour[i], changed = max(srcs, key=lambda s: s[0])[1], True
    first = next(c for c in colour if c is not None)
    return [c if c is not None else first for c in colour]


def _glue_key(eqn) -> tuple | None:
    """Glue inside a microbatch stays with that microbatch's pass, so it never links two microbatches."""
    m, backward = pass_of(eqn.source_info.name_stack)
    return None if m is None else (m, backward)


def _group(eqns: Sequence, colour: Sequence[Placement], units: Sequence[Unit | None]) -> list[Segment]:
    """Cut the equations into segments (see the module docstring).

    In a pipeline, glue joins a segment only to extend it (it reads the
    segment's latest results) or, reading no other segment, a segment that
    reads none either: joining anything else would make the glue, and all
    that consumes it, wait for unrelated work (say, the loss of the last
    microbatch before the first backward pass).
    """
    pipelined = any(u is not None for u in units)
    segments: list[Segment] = []
    latest: dict[tuple, int] = {}
    sources: dict[tuple, int] = {}
    producer: dict[Var, int] = {}
    for i, e in enumerate(eqns):
        key = (colour[i], units[i] if units[i] is not None else _glue_key(e))
        deps = {producer[v] for v in e.invars if not isinstance(v, Literal) and v in producer}
        k = latest.get(key)
        if pipelined and units[i] is None:
            k = sources.get(key) if not deps else (k if k is not None and k == max(deps) else None)
        if k is None or any(d > k for d in deps):
            k = len(segments)
            segments.append(Segment(k, colour[i], unit=units[i]))
            latest[key] = k
            if pipelined and units[i] is None and not deps:
                sources[key] = k
        segments[k].eqns.append(e)
        for v in e.outvars:
            producer[v] = k
    return segments


def link_segments(jaxpr: Jaxpr, consts: dict, segments: list[Segment], schedule: Schedule | None = None,
                  recomputed: Collection[int] = frozenset()) -> Plan:
    """Number ``segments`` (in execution order) and work out what flows between them.

    A step input lives on the submesh of its first consumer, not counting
    ``recomputed`` equations (ids): a recomputed copy reads a copy of the input
    (`recompute`), and the original's submesh is where its updated value (a
    step counter's) is made.
    """
    producer: dict[Var, int] = {}
    input_placement: dict[Var, Placement] = {}
    read_by_copies: dict[Var, Placement] = {}
    for k, seg in enumerate(segments):
        seg.index = k
        defined, needed = set(), []
        for e in seg.eqns:
            for v in e.invars:
                if isinstance(v, Literal) or v in defined:
                    continue
                if v not in needed:
                    needed.append(v)
                if v in producer:
                    continue
                if id(e) in recomputed:
                    read_by_copies.setdefault(v, seg.placement)
                else:
                    input_placement.setdefault(v, seg.placement)
            defined.update(e.outvars)
        seg.invars = needed
        for v in defined:
            producer[v] = k
    for v, placement in read_by_copies.items():
        input_placement.setdefault(v, placement)
    outputs = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    used_later: set[Var] = set(outputs)
    for seg in reversed(segments):
        seg.outvars = [v for e in seg.eqns for v in e.outvars if v in used_later]
        used_later.update(seg.invars)
    return Plan(jaxpr, segments, input_placement, producer, consts, schedule)


def partition(closed: ClosedJaxpr, pipelines: Sequence[Pipeline] = ()) -> Plan:
    """The plan of a step whose nested calls are already inlined (`inline_calls`).

    ``pipelines`` are the `microbatch` calls seen while tracing; their schedule
    orders the segments.
    """
    step_jaxpr, rewritten = closed.jaxpr, split_scans(closed)
    if rewritten is not None:  # a scanned stack split over stages: its scans, parameters and updates in parts
        closed = rewritten.closed
    implicit = _implicit(closed.jaxpr.eqns)
    eqns = place_per_microbatch(closed.jaxpr.eqns, implicit)  # one for one: the same scope stacks
    consts = dict(zip(closed.jaxpr.constvars, closed.consts))
    placed: dict[int, Placement] = dict(rewritten.placed) if rewritten is not None else {}
    if any(p.split_backward for p in pipelines):  # zero-bubble: a task's backward splits into B and W
        eqns, consts, inlined = inline_backward_tasks(eqns, consts)
        placed.update(inlined)
        implicit = _implicit(eqns)
    initial = _initial_colours(eqns, implicit, placed)
    pinned = [c is not None for c in initial]
    tasks = [c for c in initial if c is not None]
    if not tasks:
        raise ValueError("partition() needs a function that calls at least one task")
    _check_overlaps(tasks)
    units = _units(eqns, initial)
    colour = _propagate(eqns, initial)
    warn_whole_stacks(eqns, pinned, colour)
    if current_knobs().enable_recomputation:  # values of constants and small inputs: computed where read
        eqns, colour, units, copies = recompute_constants(eqns, colour, units, closed.jaxpr.outvars,
                                                          closed.jaxpr.invars, pinned)
    else:
        copies = set()
    segments = _group(eqns, colour, units)
    segments, schedule = schedule_segments(segments, pipelines)
    _check_split_backprop(segments, schedule)
    plan = link_segments(closed.jaxpr, consts, segments, schedule, recomputed=copies)
    plan.boundary = rewritten.boundary if rewritten is not None else None
    plan.step_jaxpr = step_jaxpr
    return plan


def _check_split_backprop(segments: Sequence[Segment], schedule: Schedule | None) -> None:
    """A `Task` asked for its backward to be split, but the schedule does not split any: say so."""
    asked = sorted({str(s.placement.name) for s in segments if split_names(s.placement) is not None})
    if asked and (schedule is None or not schedule.split_backward):
        what = f"the schedule {schedule!r}" if schedule is not None else "a step without microbatch()"
        warnings.warn(f"tasks {asked} ask for split_backprop, but {what} does not split backward passes; use "
                      f"microbatch(..., schedule='zero-bubble-h1' or 'zero-bubble-h2') to run the input and "
                      f"weight gradients apart", stacklevel=4)


def _check_overlaps(placements: Sequence[Placement]) -> None:
    """Submeshes must be equal or disjoint: a device may not serve two differently shaped tasks."""
    seen = list(dict.fromkeys(placements))
    for i, a in enumerate(seen):
        for b in seen[i + 1 :]:
            common = a.devices & b.devices
            if common and a.mesh != b.mesh:
                raise ValueError(
                    f"tasks {a.name!r} ({a.describe()}) and {b.name!r} ({b.describe()}) share devices "
                    f"{sorted(d.id for d in common)} on different meshes. Tasks must run on disjoint "
                    f"device sets, or on exactly the same mesh (same devices, shape and axis names)"
                )


@without_gc
def make_plan(closed: ClosedJaxpr, placement: Placement, pipelines: Sequence[Pipeline] = ()) -> Plan:
    """The one plan of a traced step: ``placement`` alone (SPMD: one segment), or, when the step calls
    tasks, its nested calls inlined and the equations partitioned over the tasks' submeshes (MPMD)."""
    check_split_registrations(closed.jaxpr)
    if has_tasks(closed.jaxpr):
        plan = partition(inline_calls(closed), pipelines)
        plan.step_jaxpr = closed.jaxpr
        return plan
    whole = Segment(0, placement, list(closed.jaxpr.eqns))
    return link_segments(closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts)), [whole])
