"""A whole step's predicted time from its programs' times: SPMD, tasks in sequence, or a pipeline schedule.

A pipeline is timed by its schedule's own simulator (`Schedule.simulate`):
a forward action costs its stage's forward programs per microbatch, a
backward action its stage's backward (and weight-gradient) programs, each
stage its own (an unbalanced pipeline waits on its slowest stage where the
schedule makes it), and every dependency between stages the mean copy into
an action. Segments outside the schedule (the optimizer update, glue) are
added per stage after it, the busiest stage's. Tasks without a schedule run
one after another.

Devices that share compute (a profile whose ``alone_speedup`` is above 1:
simulated CPU devices on one host's cores): a stage of ``k`` of the step's
``n`` devices computing while the others idle runs faster than with all
busy, by the speed-up `calibrate` measured with ``k`` devices busy
(``busy_speedup``, else ``alone_speedup``), but by no more than ``n / k``:
the host's throughput shared among fewer devices. (`calibrate` measures it on
matrix products, which XLA:CPU runs more than ``n / k`` times faster on fewer
device threads; a whole program's other kernels and page faults do not gain
that: measured on the planner benchmark's pipelines, run 16 of
`benchmarks/RESULTS.md`.) The schedule is simulated at those rates.
But the host's cores do not run two stages' programs at once any faster
than one after the other (measured on XLA:CPU, `benchmarks/host_sharing.py`:
programs on disjoint groups of the devices dispatched together take the sum
of their times), so
the step cannot take less than every program execution and copy one after
another, each at its own rate; the pipeline takes the larger of the two.
With ``alone_speedup`` 1 (each device its own compute, every datasheet
profile) the model is the plain schedule simulation.
"""

from __future__ import annotations

from typing import Any

from .profiles import HardwareProfile
from .programs import ProgramCost
from .timing import ProgramTime, launch_overhead, program_time, transfer_time

__all__ = ["StepTiming", "step_timing"]

_TINY = 1e-12  # the simulator wants positive costs: a pass with no program costs next to nothing


class StepTiming:
    """Seconds: ``programs`` (one execution each, by name), ``transfers`` (all copies between stages), and
    ``total``; for a pipeline, ``pipeline`` (the schedule's simulated makespan) and ``outside`` (the rest)."""

    def __init__(self, programs: dict[str, ProgramTime], transfers: float, total: float,
                 pipeline: float = 0.0, outside: float = 0.0):
        self.programs, self.transfers, self.total = programs, transfers, total
        self.pipeline, self.outside = pipeline, outside


def _one_node(plan: Any, src: int, dst: int, profile: HardwareProfile, n_devices: int) -> bool:
    """Whether a copy from segment ``src`` (-1: a step input) to ``dst`` stays inside one node: both
    submeshes' devices on one node (an input's source unknown: the step's devices fit in one node)."""
    if src < 0:
        return n_devices <= profile.devices_per_node
    ids = {d.id for i in (src, dst) for d in plan.segments[i].placement.devices}
    return len({profile.node_of(i) for i in ids}) == 1


def step_timing(plan: Any, programs: tuple[ProgramCost, ...], segment_program: dict[int, int] | None,
                transfers: tuple[tuple[str, int, int, int], ...], profile: HardwareProfile, dtype: str | None,
                n_devices: int) -> StepTiming:
    """The step's time (see the module docstring); ``segment_program`` None: one SPMD program."""
    times = {p.name: program_time(p, profile, dtype) for p in programs}
    if segment_program is None:
        (p,) = programs
        return StepTiming(times, 0.0, times[p.name].total)
    copies: dict[int, float] = {}
    for _, src, dst, size in transfers:
        inside = _one_node(plan, src, dst, profile, n_devices)
        copies[dst] = copies.get(dst, 0.0) + transfer_time(size, profile, inside_node=inside)
    moved = sum(copies.values())
    took = {k: times[programs[i].name].total for k, i in segment_program.items()}
    schedule = plan.schedule
    if schedule is None:
        return StepTiming(times, moved, sum(took.values()) + moved)
    shared = max(1.0, profile.alone_speedup)
    measured = dict(profile.busy_speedup)

    def speedup(k: int) -> float:
        """How much faster k devices compute with the step's other devices idle than with all busy."""
        return min(measured.get(k, shared), n_devices / k)

    launch = launch_overhead(profile)
    forward: dict[int, float] = {}
    backward: dict[int, float] = {}
    outside: dict[frozenset, float] = {}
    into_actions = []
    host = moved  # on a shared host: every execution and copy one after another, each at its own rate
    for seg in plan.segments:
        t = took.get(seg.index, 0.0)
        if seg.index in took:  # its work faster by the idle devices' share of the host; its launch as it is
            t = launch + (t - launch) / speedup(len(seg.placement.devices))
            host += t
        if seg.action is None:
            outside[seg.placement.devices] = outside.get(seg.placement.devices, 0.0) + t + copies.get(seg.index, 0)
            continue
        into_actions.append(copies.get(seg.index, 0.0))
        stage = schedule.physical_stage(seg.action)
        per = forward if seg.action.kind == "F" else backward
        per[stage] = per.get(stage, 0.0) + t
    m = schedule.num_microbatches
    per_stage = {s: (max(forward.get(s, 0.0) / m, _TINY), max(backward.get(s, 0.0) / m, _TINY))
                 for s in set(forward) | set(backward)}
    comm = sum(into_actions) / len(into_actions) if into_actions else 0.0
    makespan = schedule.simulate(comm_time=comm, stage_times=per_stage).makespan
    rest = max(outside.values(), default=0.0)
    if shared > 1.0 and host > makespan + rest:
        return StepTiming(times, moved, host, pipeline=host - rest, outside=rest)
    return StepTiming(times, moved, makespan + rest, pipeline=makespan, outside=rest)
