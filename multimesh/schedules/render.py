"""A schedule as text: one row per stage, one column per time slot (the picture is `plot`'s)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .actions import BACKWARD, FORWARD, WEIGHT, Action, PipelineShape
from .simulate import run

__all__ = ["render", "stage_labels"]


def render(shape: PipelineShape, per_stage: Mapping[int, Sequence[Action]], name: str,
           backward_slots: int = 1, stage_names: Sequence[str] | None = None) -> str:
    """Every action takes one slot (a backward ``backward_slots``; in a split schedule ``B`` and ``W``
    each ``backward_slots``); cells show ``F3``/``B3``/``W3`` (``F3.1`` = chunk 1), ``.`` when idle.
    A row is headed ``stage 0``, or ``stage 0 stem+block.0-1`` given the stages' names (`stage_labels`)."""
    if not isinstance(backward_slots, int) or backward_slots < 1:
        raise ValueError(f"backward_slots must be a positive int, got {backward_slots!r}")
    slots = float(backward_slots)
    costs: dict[int, dict[str, float]] = {st: {FORWARD: 1.0, BACKWARD: slots, WEIGHT: slots} for st in per_stage}
    tl = run(shape, per_stage, costs, 0.0, name)
    width = int(round(tl.makespan))
    grid = [["."] * width for _ in range(shape.num_stages)]
    for a, (start, end) in tl.spans.items():
        for t in range(int(round(start)), int(round(end))):
            grid[shape.physical_stage(a)][t] = a.label
    cell = max([len(c) for row in grid for c in row] + [1])
    heads = stage_labels(shape.num_stages, stage_names)
    label = max(len(h) for h in heads)
    return "\n".join(f"{head.ljust(label)} | " + " ".join(c.ljust(cell) for c in row).rstrip()
                     for head, row in zip(heads, grid))


def stage_labels(num_stages: int, stage_names: Sequence[str] | None = None) -> list[str]:
    """``stage 0``, ... or, given one name per stage, ``stage 0 stem+block.0-1``, ..."""
    if stage_names is None:
        return [f"stage {s}" for s in range(num_stages)]
    if len(stage_names) != num_stages:
        raise ValueError(f"stage_names gives {len(stage_names)} names for a schedule of {num_stages} stages: "
                         f"{list(stage_names)}; give one per stage")
    return [f"stage {s} {n}" for s, n in enumerate(stage_names)]
