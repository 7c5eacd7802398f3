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

It also measures what a pipeline schedule promises: the number of
microbatches whose forward activations (the residuals a backward pass will
read) are alive on each stage at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend.core import Literal, Var
from jax.sharding import NamedSharding, PartitionSpec

from ..deferred import resolve_deferred
from ..scope import use_scope
from .implicit import is_backprop, microbatch_of
from .plan import Plan
from .programs import Program, group_programs, run_program
from .segment import Segment
from .transfer import reshard_to

__all__ = ["ReshardError", "RunStats", "Runtime"]


class ReshardError(ValueError):
    """A value could not be moved onto the submesh of the task that needs it."""


@dataclass
class RunStats:
    """What the last run did.

    ``executed``: segment labels in execution order; ``peak_live_activations``:
    per pipeline stage (device group), the most microbatches (interleaved:
    microbatch chunks) whose stashed forward activations were alive there at
    once.
    """

    executions: int = 0
    transfers: int = 0
    bytes_moved: int = 0
    executed: list[str] = field(default_factory=list)
    peak_live_activations: dict[int, int] = field(default_factory=dict)


Key = tuple  # (var, devices of the copy; None for a step input as given)


class Runtime:
    """Compiles each segment of a plan and executes the plan."""

    def __init__(self, plan: Plan, input_shardings: dict[Var, NamedSharding], *, sync_every: int = 16,
                 donated: set[Var] = frozenset()):
        self.plan = plan
        self.input_shardings = input_shardings
        self.sync_every = sync_every
        self.stats = RunStats()
        self._free_after = _lifetimes(plan)
        self.programs = group_programs(plan.segments, _donations(plan, donated))
        self._calls: list[tuple[Any, list]] = [None] * len(plan.segments)  # type: ignore[list-item]
        for program in self.programs:
            fn = _compile(program)
            replicated = NamedSharding(program.placement.mesh, PartitionSpec())
            for k in program.segments:
                self._calls[k] = (fn, [jax.device_put(v, replicated) for v in program.literal_values(k)])
        self._stash = _stashed_activations(plan.segments)
        self._stage_at = {s.placement.devices: s.stage for s in plan.segments if s.stage is not None}

    def _home(self, v: Var) -> frozenset | None:
        k = self.plan.producer.get(v)
        return None if k is None else self.plan.segments[k].placement.devices

    def _move(self, v: Var, x: Any, seg: Segment) -> Any:
        if isinstance(x, jax.Array) and x.sharding.device_set <= seg.placement.devices:
            return x
        target = self.input_shardings.get(v) if v not in self.plan.producer else None
        try:
            if target is not None and target.device_set <= seg.placement.devices:
                moved = jax.device_put(x, target)
            else:
                moved = reshard_to(x, seg.placement.mesh)
        except Exception as e:
            k = self.plan.producer.get(v)
            origin = "the step's input" if k is None else f"segment [{k}] {self.plan.segments[k].label}"
            where = getattr(x, "sharding", None)
            raise ReshardError(
                f"cannot move {v.aval.str_short()} from {origin} ({where}) to task {seg.placement.name!r} "
                f"({seg.placement.describe()}), needed by segment [{seg.index}] {seg.label}: {e}. Values move "
                f"between submeshes with jax.device_put, which needs both sides in this process; across "
                f"processes, keep each pipeline stage's devices within one process"
            ) from e
        self.stats.transfers += 1
        self.stats.bytes_moved += moved.nbytes
        return moved

    def __call__(self, flat_inputs: Sequence[Any]) -> list:
        plan, stats = self.plan, RunStats()
        self.stats = stats
        held: dict[Key, Any] = {}
        live: dict[int, Counter] = {}

        def hold(key: Key, x: Any, delta: int = 1) -> None:
            if delta > 0:
                held[key] = x
            elif held.pop(key, _GONE) is _GONE:
                return
            if key[0] in self._stash and key[1] in self._stage_at:
                live.setdefault(self._stage_at[key[1]], Counter())[self._stash[key[0]]] += delta

        for v, x in zip(plan.jaxpr.invars, flat_inputs):
            hold((v, None), x)
        for v, x in plan.consts.items():
            hold((v, None), x)
        last = None
        for seg, (fn, literals) in zip(plan.segments, self._calls):
            here = seg.placement.devices
            for v in seg.invars:
                if (v, here) not in held:
                    hold((v, here), self._move(v, held[(v, self._home(v))], seg))
            outs = fn(*[held[(v, here)] for v in seg.invars], *literals)
            for v, x in zip(seg.outvars, outs):
                hold((v, here), x)
            stats.executions += 1
            stats.executed.append(seg.label)
            for stage, c in live.items():
                stats.peak_live_activations[stage] = max(stats.peak_live_activations.get(stage, 0), len(+c))
            for key in self._free_after[seg.index]:
                hold(key, None, -1)
            if outs:
                last = outs[0]
            if self.sync_every and stats.executions % self.sync_every == 0 and last is not None:
                jax.block_until_ready(last)
        return [v.val if isinstance(v, Literal) else held[(v, self._home(v))] for v in plan.jaxpr.outvars]


_GONE = object()


def _compile(program: Program) -> Any:
    """The program as one `jax.jit` on its submesh, deferred constraints resolved with its rules."""
    run = run_program(program, resolve_deferred)

    def segment(*args: Any) -> list:
        with use_scope(program.placement.scope):
            return run(*args)

    segment.__name__ = f"{program.placement.name}_program{program.index}"
    return jax.jit(segment, donate_argnums=program.donate)


def _uses(plan: Plan) -> dict[Var, dict[frozenset, list[int]]]:
    """For each value, the segments reading it, per submesh."""
    uses: dict[Var, dict[frozenset, list[int]]] = {}
    for seg in plan.segments:
        for v in seg.invars:
            uses.setdefault(v, {}).setdefault(seg.placement.devices, []).append(seg.index)
    return uses


def _lifetimes(plan: Plan) -> dict[int, list[Key]]:
    """After which segment each copy of each value dies.

    A copy on a submesh dies after its last use there; the original (on its
    producer's submesh, or the step input as given) also serves every copy,
    so it lives until each other submesh has taken its copy. Step outputs
    never die.
    """
    uses = _uses(plan)
    outputs = {v for v in plan.jaxpr.outvars if not isinstance(v, Literal)}
    free: dict[int, list[Key]] = {i: [] for i in range(len(plan.segments))}
    for v, where in uses.items():
        k = plan.producer.get(v)
        home = None if k is None else plan.segments[k].placement.devices
        for loc, idx in where.items():
            if loc != home:
                free[max(idx)].append((v, loc))
        if v not in outputs:
            serves = [min(idx) for loc, idx in where.items() if loc != home] + where.get(home, [])
            free[max(serves)].append((v, home))
    return free


def _donations(plan: Plan, donated: set[Var]) -> dict[int, tuple[int, ...]]:
    """Per segment, the arguments to donate: donated step inputs at their last use, on their only submesh."""
    uses = _uses(plan)
    outputs = {v for v in plan.jaxpr.outvars if not isinstance(v, Literal)}
    return {seg.index: tuple(i for i, v in enumerate(seg.invars)
                             if v in donated and v not in outputs and len(uses[v]) == 1
                             and max(uses[v][seg.placement.devices]) == seg.index)
            for seg in plan.segments}


def _stashed_activations(segments: Sequence[Segment]) -> dict[Var, tuple[int, int]]:
    """Values computed in a microbatch's forward pass and read by a backward unit.

    var -> (microbatch, chunk of the backward unit reading it): counting
    distinct pairs per stage counts microbatches (interleaved: microbatch
    chunks) whose activations are held, as schedules do.
    """
    chunk_of: dict[Var, int] = {}
    for s in segments:
        for e in s.eqns:
            if is_backprop(e.source_info.name_stack) and microbatch_of(e.source_info.name_stack) is not None:
                for v in e.invars:
                    if not isinstance(v, Literal):
                        chunk_of.setdefault(v, s.action.chunk if s.action is not None else 0)
    stash = {}
    for seg in segments:
        for e in seg.eqns:
            m = microbatch_of(e.source_info.name_stack)
            if m is not None and not is_backprop(e.source_info.name_stack):
                stash.update((v, (m, chunk_of[v])) for v in e.outvars if v in chunk_of)
    return stash
