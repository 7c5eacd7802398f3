"""A schedule as text: one row per stage, one column per time slot (the picture is `plot`'s)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .actions import BACKWARD, FORWARD, WEIGHT, Action, PipelineShape
from .simulate import run

__all__ = ["render"]


def render(shape: PipelineShape, per_stage: Mapping[int, Sequence[Action]], name: str,
           backward_slots: int = 1) -> str:
    """Every action takes one slot (a backward ``backward_slots``; in a split schedule ``B`` and ``W``
    each ``backward_slots``); cells show ``F3``/``B3``/``W3`` (``F3.1`` = chunk 1), ``.`` when idle."""
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
    label = len(f"stage {shape.num_stages - 1}")
    return "\n".join(f"{f'stage {s}'.ljust(label)} | " + " ".join(c.ljust(cell) for c in row).rstrip()
                     for s, row in enumerate(grid))
