"""A schedule run in simulated time: each stage takes its actions in its own order, each as soon as
the stage is free and what it depends on has finished; and the live activations that order holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from .actions import BACKWARD, FORWARD, WEIGHT, Action, PipelineShape

__all__ = ["Timeline", "peak_live_activations", "run", "stage_costs"]

#: physical stage -> action kind -> the time one such action takes
Costs = dict[int, dict[str, float]]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A simulated run of a schedule (`Schedule.simulate`).

    Attributes:
      spans: action -> ``(start, end)`` time.
      makespan: time at which the last action ends.
      busy: physical stage -> total time it spends computing.
      num_stages: number of physical stages.
    """

    spans: Mapping[Action, tuple[float, float]]
    makespan: float
    busy: Mapping[int, float]
    num_stages: int

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of the ``num_stages x makespan`` stage-time area."""
        if self.makespan <= 0:
            return 0.0
        total = self.num_stages * self.makespan
        return max(0.0, 1.0 - sum(self.busy.values()) / total)

    def start(self, action: Action) -> float:
        return self.spans[action][0]

    def end(self, action: Action) -> float:
        return self.spans[action][1]


def stage_costs(shape: PipelineShape, forward: float, backward: float) -> Costs:
    """Every stage's per-kind action costs from a stage-chunk's forward and backward cost: a split
    backward costs half for ``B`` and half for ``W``."""
    b, w = (backward / 2, backward / 2) if shape.split_backward else (backward, backward)
    return {stage: {FORWARD: forward, BACKWARD: b, WEIGHT: w} for stage in range(shape.num_stages)}


def run(shape: PipelineShape, per_stage: Mapping[int, Sequence[Action]], costs: Costs, comm_time: float,
        name: str) -> Timeline:
    """List-schedule each stage's order with per-stage, per-kind action costs (``costs[stage][kind]``),
    ``comm_time`` added on every dependency that crosses stages; a deadlock is a ValueError naming
    schedule ``name`` and where each stage waits."""
    for stage, of_kind in costs.items():
        if min(of_kind.values()) <= 0:
            raise ValueError(f"costs must be positive, got forward={of_kind[FORWARD]}, "
                             f"backward={of_kind[BACKWARD]} on stage {stage}")
    if comm_time < 0:
        raise ValueError(f"comm_time must be non-negative, got comm={comm_time}")
    pos = {s: 0 for s in per_stage}
    free = {s: 0.0 for s in per_stage}
    busy = {s: 0.0 for s in per_stage}
    spans: dict[Action, tuple[float, float]] = {}
    remaining = sum(len(q) for q in per_stage.values())
    while remaining:
        progress = False
        for s, q in per_stage.items():
            while pos[s] < len(q):
                a = q[pos[s]]
                deps = shape.dependencies(a)
                if not all(d in spans for d in deps):
                    break
                t = free[s]
                for d in deps:
                    t = max(t, spans[d][1] + (comm_time if shape.physical_stage(d) != s else 0.0))
                cost = costs[s][a.kind]
                spans[a] = (t, t + cost)
                free[s] = t + cost
                busy[s] += cost
                pos[s] += 1
                remaining -= 1
                progress = True
        if not progress:
            blocked = ", ".join(f"stage {s} waits at {q[pos[s]]}" for s, q in per_stage.items() if pos[s] < len(q))
            raise ValueError(f"invalid {name} schedule: deadlock ({blocked})")
    makespan = max((e for _, e in spans.values()), default=0.0)
    return Timeline(spans, makespan, busy, shape.num_stages)


def peak_live_activations(shape: PipelineShape, per_stage: Mapping[int, Sequence[Action]]) -> dict[int, int]:
    """Physical stage -> the most microbatches whose forward has run there and whose backward has not
    finished (with ``B``, or with ``W`` in a split schedule: ``W`` still reads the stashed inputs)."""
    release = WEIGHT if shape.split_backward else BACKWARD
    out: dict[int, int] = {}
    for s, acts in per_stage.items():
        live = peak = 0
        if not shape.forward_only:
            for a in acts:
                live += 1 if a.kind == FORWARD else -1 if a.kind == release else 0
                peak = max(peak, live)
        out[s] = peak
    return out
