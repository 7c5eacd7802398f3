"""Run an MPMD plan: one `jax.jit` per segment, values resharded between submeshes.

The runtime walks the segments in plan order (the schedule's, under a
pipeline). Before a segment runs, each of its inputs that lives on another
submesh is moved with `jax.device_put` (same `PartitionSpec` when the
destination mesh can hold it, else replicated there); the copy is kept beside
the original until the value's last use. Values are dropped after their last
use. JAX dispatches asynchronously, so different submeshes work at once;
every `sync_every` executions the runtime waits for the latest result,
bounding the work in flight (XLA:CPU aborts when too many executions with
collectives are queued).

With several processes (multi-controller JAX), every process walks the same
steps: a segment whose submesh has no device of this process is a call that
runs nothing here and returns placeholders, and each transfer is made by the
processes at both ends (`core.transfer.move`), so all processes make the same
calls in the same order and none waits for a call another never makes.

Consecutive actions of one stage and program may run as one host call
(`run.grouping`: one `jax.jit` calling the program once per member), in an
order that keeps each stage's own; ``group_actions`` (default: the
``MULTIMESH_GROUP_ACTIONS`` variable, else 1: each action alone) bounds their
number.

It also measures what a pipeline schedule promises: the number of
microbatches whose forward activations (the residuals a backward pass will
read) are alive on each stage at once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend.core import Literal, Var
from jax.sharding import NamedSharding, PartitionSpec

from ..core.gc_pause import without_gc
from ..core.placement import use_placement
from ..core.transfer import move, put, target_on
from ..plan.partition import Plan
from ..plan.programs import Program, group_programs, run_program
from ..plan.segment import Segment, nbytes
from ..trace.constraints import resolve_deferred
from ..trace.implicit import pass_of
from .grouping import Source, default_group_size, group_order, grouped_program

__all__ = ["ReshardError", "RunStats", "Runtime"]


class ReshardError(ValueError):
    """A value could not be moved onto the submesh of the task that needs it."""


@dataclass
class RunStats:
    """What the last run did.

    ``executions``: segments run; ``dispatches``: program calls the host made
    for them (fewer where actions ran in groups); ``executed``: segment labels
    in execution order; ``peak_live_activations``: per pipeline stage (device
    group), the most microbatches (interleaved: microbatch chunks) whose
    stashed forward activations were alive there at once.
    """

    executions: int = 0
    dispatches: int = 0
    transfers: int = 0
    bytes_moved: int = 0
    executed: list[str] = field(default_factory=list)
    peak_live_activations: dict[int, int] = field(default_factory=dict)


Key = tuple  # (var, devices of the copy; None for a step input as given)


@dataclass
class _Step:
    """One segment's execution, worked out once: what to copy in, call, keep and free."""

    segment: Segment
    label: str
    fn: Any
    literals: list
    inputs: list[tuple[Var, Key]]  # step inputs to place here (a copy only when not already here)
    copies: list[tuple[Var, Key, Key]]  # produced on another submesh: (value, original, copy here)
    copy_bytes: int  # what the copies move
    args: list[Key]
    outs: list[Key]
    frees: list[Key]
    local: bool  # some of its devices belong to this process (it computes here, not only a placeholder)
    targets: list[NamedSharding] | None = None  # where the copies go, learnt from the first originals
    # (stage, label) of its copies and outputs that are stashed activations; (key, stage, label) of its frees that are
    stashed_in: list[tuple[int, tuple]] = field(default_factory=list)
    stashed_out: list[tuple[Key, int, tuple]] = field(default_factory=list)


@dataclass
class _Call:
    """One host call: one step's program, or one program per member of a group of steps (`run.grouping`)."""

    steps: list[_Step]
    fn: Any
    args: list[Key]
    literals: list
    outs: list[Key]  # what the call returns (a group's: its members' outputs read after it)
    local: bool


class Runtime:
    """Compiles each segment of a plan and executes the plan.

    ``group_actions``: the most consecutive actions of one stage and program run as one host call
    (`run.grouping`; 1: each alone); None: ``MULTIMESH_GROUP_ACTIONS``, else 1.
    """

    @without_gc
    def __init__(self, plan: Plan, input_shardings: dict[Var, NamedSharding], *, sync_every: int = 16,
                 donated: Collection[Var] = frozenset(), group_actions: int | None = None):
        self.plan = plan
        self.input_shardings = input_shardings
        self.sync_every = sync_every
        self.stats = RunStats()
        self.programs = group_programs(plan.segments, _donations(plan, donated))
        calls: list[tuple[Any, list]] = [None] * len(plan.segments)  # type: ignore[list-item]
        program_of = [0] * len(plan.segments)
        for program in self.programs:
            fn = _compile(program)
            replicated = NamedSharding(program.placement.mesh, PartitionSpec())
            for k in program.segments:
                calls[k] = (fn, [put(v, replicated) for v in program.literal_values(k)])
                program_of[k] = program.index
        if group_actions is None:
            group_actions = default_group_size()
        self.group_actions = group_actions
        groupable = [seg.action is not None and not self.programs[program_of[seg.index]].donate
                     for seg in plan.segments]
        groups = group_order(plan.segments, plan.producer, program_of, groupable, group_actions)
        self._steps = _steps(plan, calls, [k for group in groups for k in group])
        stash = _stashed_activations(plan.segments)
        stage_at = {s.placement.devices: s.stage for s in plan.segments if s.stage is not None}
        self._stash = {}  # key -> (stage, (microbatch, chunk)) for copies of stashed forward activations
        for step in self._steps:
            for key in step.outs + [c for _, _, c in step.copies]:
                if key in stash and key[1] in stage_at:
                    self._stash[key] = (stage_at[key[1]], stash[key])
        for step in self._steps:
            step.stashed_in = [self._stash[k] for k in [c for _, _, c in step.copies] + step.outs if k in self._stash]
            step.stashed_out = [(k, *self._stash[k]) for k in step.frees if k in self._stash]
        self._calls = self._group_calls([len(group) for group in groups])

    def _group_calls(self, sizes: Sequence[int]) -> list[_Call]:
        """The host calls: each run of ``sizes`` consecutive steps as one."""
        made: dict[tuple, Any] = {}  # one grouped program per shape of group
        out, start = [], 0
        for size in sizes:
            members = self._steps[start:start + size]
            start += size
            if size == 1:
                (step,) = members
                out.append(_Call(members, step.fn, step.args, step.literals, step.outs, step.local))
                continue
            made_by: dict[Key, Source] = {}  # a member's output, or the group's argument (-1, position)
            args: list[Key] = []
            sources: list[tuple[Source, ...]] = []
            for m, step in enumerate(members):
                for key in step.args:
                    if key not in made_by:
                        made_by[key] = (-1, len(args))
                        args.append(key)
                sources.append(tuple(made_by[key] for key in step.args))
                made_by.update((key, (m, i)) for i, key in enumerate(step.outs))
            literals: list = []  # after the values: each member's lifted literals
            for m, step in enumerate(members):
                sources[m] += tuple((-1, len(args) + len(literals) + i) for i in range(len(step.literals)))
                literals.extend(step.literals)
            dies = {k for step in members for k in step.frees} - set(self._stash)  # only members read these
            exported = [(m, i) for m, step in enumerate(members) for i, key in enumerate(step.outs) if key not in dies]
            shape = (tuple(id(step.fn) for step in members), tuple(sources), tuple(exported))
            fn = made.get(shape)
            if fn is None:
                fn = made[shape] = grouped_program(
                    [(step.fn, src) for step, src in zip(members, sources)], exported,
                    f"{members[0].segment.placement.name}_group{len(made)}")
            out.append(_Call(members, fn, args, literals, [members[m].outs[i] for m, i in exported],
                             any(step.local for step in members)))
        return out

    @property
    def steps(self) -> list[_Step]:
        """Each segment's execution in order, worked out once: what `multimesh.estimate` walks abstractly."""
        return self._steps

    @property
    def calls(self) -> list[_Call]:
        """The host calls, in order: each one step, or a group of steps run by one program (`run.grouping`)."""
        return self._calls

    def stashed(self) -> dict[Key, tuple[int, tuple]]:
        """Copies of stashed forward activations: key -> (stage, (microbatch, chunk))."""
        return dict(self._stash)

    def _home(self, v: Var) -> frozenset | None:
        k = self.plan.producer.get(v)
        return None if k is None else self.plan.segments[k].placement.devices

    def _reshard_error(self, v: Var, x: Any, seg: Segment, e: Exception) -> ReshardError:
        k = self.plan.producer.get(v)
        origin = "the step's input" if k is None else f"segment [{k}] {self.plan.segments[k].label}"
        where = getattr(x, "sharding", None)
        return ReshardError(
            f"cannot move {v.aval.str_short()} from {origin} ({where}) to task {seg.placement.name!r} "
            f"({seg.placement.describe()}), needed by segment [{seg.index}] {seg.label}: {e}. Values move "
            f"between submeshes with jax.device_put; across processes, start them with "
            f"multimesh.distributed.initialize (it enables JAX's cross-host transfers)"
        )

    def _place_input(self, v: Var, x: Any, seg: Segment) -> Any:
        """A step input on ``seg``'s submesh: as given when it spans it or has its planned sharding, else
        moved to its sharding there.

        An array on only some of the submesh's devices (a state laid out for
        another mesh) is moved too: one program cannot take arguments
        committed to different device sets.
        """
        target = self.input_shardings.get(v)
        if target is not None and not target.device_set <= seg.placement.devices:
            target = None
        if isinstance(x, jax.Array) and (x.sharding.device_set == seg.placement.devices or x.sharding == target):
            return x
        if target is None:
            target = target_on(x, seg.placement.mesh)
        try:
            (moved,) = move([x], [target])
        except Exception as e:
            raise self._reshard_error(v, x, seg, e) from e
        self.stats.transfers += 1
        self.stats.bytes_moved += moved.nbytes
        return moved

    def _copy(self, step: _Step, held: dict[Key, Any]) -> None:
        """Copy the values ``step`` reads from other submeshes, in one `core.transfer.move`."""
        xs = [held[src] for _, src, _ in step.copies]
        if step.targets is None:
            step.targets = [target_on(x, step.segment.placement.mesh) for x in xs]
        try:
            moved = move(xs, step.targets)
        except Exception as e:
            for (v, _, _), x, t in zip(step.copies, xs, step.targets):  # name the value that cannot move
                try:
                    move([x], [t])
                except Exception as one:
                    raise self._reshard_error(v, x, step.segment, one) from one
            raise self._reshard_error(step.copies[0][0], xs[0], step.segment, e) from e
        for (_, _, dst), x in zip(step.copies, moved):
            held[dst] = x
        self.stats.bytes_moved += step.copy_bytes
        self.stats.transfers += len(moved)

    def __call__(self, flat_inputs: Sequence[Any]) -> list:
        plan, stats = self.plan, RunStats()
        self.stats = stats
        held: dict[Key, Any] = dict(zip(((v, None) for v in plan.jaxpr.invars), flat_inputs))
        held.update(((v, None), x) for v, x in plan.consts.items())
        live: dict[int, dict[tuple, int]] = {}  # per stage: stashed activations alive, per (microbatch, chunk)
        peak = stats.peak_live_activations

        def count(labels: Sequence[tuple[int, tuple]], delta: int) -> None:
            for stage, label in labels:
                c = live.get(stage)
                if c is None:
                    c = live[stage] = {}
                n = c.get(label, 0) + delta
                if n:
                    c[label] = n
                else:
                    del c[label]
                if len(c) > peak.get(stage, -1):
                    peak[stage] = len(c)

        last, sync_every, executed = None, self.sync_every, stats.executed
        for n, call in enumerate(self._calls, 1):
            for step in call.steps:
                for v, key in step.inputs:
                    held[key] = self._place_input(v, held[(v, None)], step.segment)
                if step.copies:
                    self._copy(step, held)
            outs = call.fn(*[held[k] for k in call.args], *call.literals)
            held.update(zip(call.outs, outs))
            for step in call.steps:
                executed.append(step.label)
                if step.stashed_in:
                    count(step.stashed_in, 1)
                if step.stashed_out:
                    count([(stage, label) for k, stage, label in step.stashed_out
                           if held.pop(k, _GONE) is not _GONE], -1)
                for k in step.frees:
                    held.pop(k, None)
            stats.executions += len(call.steps)
            stats.dispatches = n
            if outs and call.local:
                last = outs[0]
            if sync_every and n % sync_every == 0 and last is not None:
                jax.block_until_ready(last)
        return [v.val if isinstance(v, Literal) else held[(v, self._home(v))] for v in plan.jaxpr.outvars]


_GONE = object()


def _compile(program: Program) -> Any:
    """The program as one `jax.jit` on its submesh, deferred constraints resolved with its rules."""
    run = run_program(program, resolve_deferred)

    def segment(*args: Any) -> list:
        with use_placement(program.placement):
            return run(*args)

    segment.__name__ = f"{program.placement.name}_program{program.index}"
    return jax.jit(segment, donate_argnums=program.donate)


def _steps(plan: Plan, calls: Sequence[tuple[Any, list]], order: Sequence[int]) -> list[_Step]:
    """Each segment's `_Step`, in ``order``: which copies it makes (its submesh's first use of a value from
    elsewhere) and which values die after it."""
    free_after = _lifetimes(plan, order)
    steps, copied = [], set()
    for seg in (plan.segments[k] for k in order):
        fn, literals = calls[seg.index]
        here = seg.placement.devices
        inputs, copies = [], []
        for v in seg.invars:
            k = plan.producer.get(v)
            home = None if k is None else plan.segments[k].placement.devices
            if home == here or (v, here) in copied:
                continue
            copied.add((v, here))
            if home is None:
                inputs.append((v, (v, here)))
            else:
                copies.append((v, (v, home), (v, here)))
        local = any(d.process_index == jax.process_index() for d in here)
        copy_bytes = sum(nbytes(v) for v, _, _ in copies)
        steps.append(_Step(seg, seg.label, fn, literals, inputs, copies, copy_bytes, [(v, here) for v in seg.invars],
                           [(v, here) for v in seg.outvars], free_after[seg.index], local))
    return steps


def _uses(plan: Plan) -> dict[Var, dict[frozenset, list[int]]]:
    """For each value, the segments reading it, per submesh."""
    uses: dict[Var, dict[frozenset, list[int]]] = {}
    for seg in plan.segments:
        for v in seg.invars:
            uses.setdefault(v, {}).setdefault(seg.placement.devices, []).append(seg.index)
    return uses


def _lifetimes(plan: Plan, order: Sequence[int]) -> dict[int, list[Key]]:
    """After which segment each copy of each value dies, the segments running in ``order``.

    A copy on a submesh dies after its last use there; the original (on its
    producer's submesh, or the step input as given) also serves every copy,
    so it lives until each other submesh has taken its copy. Step outputs
    never die.
    """
    position = {k: i for i, k in enumerate(order)}
    first, last = (lambda ks: min(ks, key=position.__getitem__)), (lambda ks: max(ks, key=position.__getitem__))
    uses = _uses(plan)
    outputs = {v for v in plan.jaxpr.outvars if not isinstance(v, Literal)}
    free: dict[int, list[Key]] = {i: [] for i in range(len(plan.segments))}
    for v, where in uses.items():
        k = plan.producer.get(v)
        home = None if k is None else plan.segments[k].placement.devices
        for loc, idx in where.items():
            if loc != home:
                free[last(idx)].append((v, loc))
        if v not in outputs:
            serves = ([first(idx) for loc, idx in where.items() if loc != home]
                      + (where.get(home, []) if home is not None else []))
            free[last(serves)].append((v, home))
    return free


def _donations(plan: Plan, donated: Collection[Var]) -> dict[int, tuple[int, ...]]:
    """Per segment, the arguments to donate: donated step inputs at their last use on a submesh, once
    every other submesh reading them has taken its copy (they are copied before their first use there).

    A copy to other processes is only started when `move` returns: the receiver pulls the bytes later, and
    a buffer donated by then is gone ("called on deleted or donated buffer"). So an input that another
    submesh on other processes reads is not donated (a tied embedding read by both ends of a pipeline).
    """
    uses = _uses(plan)
    outputs = {v for v in plan.jaxpr.outvars if not isinstance(v, Literal)}

    def processes(devices: frozenset) -> frozenset:
        return frozenset(d.process_index for d in devices)

    def last_use(v: Var, seg: Segment) -> bool:
        where, here = uses[v], seg.placement.devices
        return max(where[here]) == seg.index and all(
            min(idx) < seg.index and processes(devices) == processes(here)
            for devices, idx in where.items() if devices != here)

    return {seg.index: tuple(i for i, v in enumerate(seg.invars) if v in donated and v not in outputs
                             and last_use(v, seg))
            for seg in plan.segments}


def _stashed_activations(segments: Sequence[Segment]) -> dict[Key, tuple[int, int]]:
    """Values computed in a microbatch's forward pass and read by a backward unit, on that unit's submesh.

    (var, devices) -> (microbatch, chunk of the backward unit reading it): counting
    distinct pairs per stage counts microbatches (interleaved: microbatch
    chunks) whose activations are held, as schedules do. Only the copy that
    the backward reads counts: a value another stage reads in its backward
    (an input the task keeps as a residual) is not held by its producer.
    """
    chunk_of: dict[Key, int] = {}
    for s in segments:
        for e in s.eqns:
            m, backward = pass_of(e.source_info.name_stack)
            if backward and m is not None:
                for v in e.invars:
                    if not isinstance(v, Literal):
                        chunk_of.setdefault((v, s.placement.devices), s.action.chunk if s.action is not None else 0)
    read_where: dict[Var, list[frozenset]] = {}
    for v, devices in chunk_of:
        read_where.setdefault(v, []).append(devices)
    stash = {}
    for seg in segments:
        for e in seg.eqns:
            m, backward = pass_of(e.source_info.name_stack)
            if m is not None and not backward:
                for v in e.outvars:
                    for devices in read_where.get(v, ()):
                        stash[(v, devices)] = (m, chunk_of[(v, devices)])
    return stash
