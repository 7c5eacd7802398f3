"""A picture of a pipeline schedule: stages x time, one box per action, bubbles left empty.

``plot_schedule(schedule, "schedule.png")`` draws the timeline that
:meth:`Schedule.simulate` computes (a forward costs ``forward_time``, a backward
``backward_time``; a split backward's ``B`` and ``W`` half of it each): one row
per device group, one box per action labelled with its microbatch (``F3``,
``B3``, ``W3``, ``F3.1`` for chunk 1), forward, backward and weight-gradient
passes in three colours, each microbatch a shade of them. Idle time (the
bubbles) is the empty background. The title gives the schedule, the bubble
fraction and the peak live activations per stage.

matplotlib is imported when a picture is drawn (the rest of multimesh does not
need it), and only its object API is used: the process's pyplot backend is
left alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .actions import BACKWARD, FORWARD
from .order import Schedule
from .render import stage_labels

__all__ = ["plot_schedule"]

#: Colour maps of the passes: forward, backward (input gradient), weight gradient.
_CMAPS: dict[str, str] = {FORWARD: "Blues", BACKWARD: "Oranges", "W": "Greens"}
_NAMES: dict[str, str] = {FORWARD: "forward", BACKWARD: "backward", "W": "weight grad"}


def plot_schedule(schedule: Schedule, path: str | os.PathLike, *, forward_time: float = 1.0,
                  backward_time: float = 2.0, title: str | None = None, dpi: int = 110,
                  stage_names: Sequence[str] | None = None) -> int:
    """Write a PNG of ``schedule``'s simulated timeline to ``path``; returns the number of boxes drawn.

    Every action of the schedule is one box (so the return value equals
    ``len(schedule)``); time runs left to right in units of one forward pass.
    ``stage_names``: one per physical stage, beside its number on the axis (a plan's stages').
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    sim = schedule.simulate(forward_time, backward_time)
    n_stages, n_micro = schedule.num_stages, schedule.num_microbatches
    width = max(6.0, min(24.0, 0.45 * sim.makespan + 2.0))
    fig = Figure(figsize=(width, 0.6 * n_stages + 1.6), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in range(n_stages):  # a light lane per stage: what stays visible between boxes is the bubble
        ax.add_patch(Rectangle((0, s - 0.42), sim.makespan, 0.84, facecolor="#f4f4f4", edgecolor="#d0d0d0", lw=0.5))
    drawn = 0
    for action, (start, end) in sorted(sim.spans.items(), key=lambda kv: kv[1]):
        row = schedule.physical_stage(action)
        shade = 0.35 + 0.45 * (action.microbatch / max(n_micro - 1, 1))
        colour = colormaps[_CMAPS[action.kind]](shade)
        ax.add_patch(Rectangle((start, row - 0.4), end - start, 0.8, facecolor=colour, edgecolor="black", lw=0.6))
        dark = shade > 0.6
        ax.text((start + end) / 2, row, action.label, ha="center", va="center",
                fontsize=8 if end - start >= 0.9 else 6, color="white" if dark else "black")
        drawn += 1
    ax.set_xlim(0, sim.makespan)
    ax.set_ylim(n_stages - 0.5, -0.5)  # stage 0 on top, as in Schedule.render()
    ax.set_yticks(range(n_stages), stage_labels(n_stages, stage_names))
    ax.set_xlabel(f"time (a forward pass = {forward_time:g}, a backward = {backward_time:g})")
    peaks = ", ".join(str(v) for _, v in sorted(schedule.peak_live_activations.items()))
    ax.set_title(title or (f"{schedule.name}: {n_stages} stages x {n_micro} microbatches; "
                           f"bubble {sim.bubble_fraction:.1%}; peak live activations per stage [{peaks}]"),
                 fontsize=9)
    kinds = [FORWARD, BACKWARD, *(["W"] if schedule.split_backward else [])]
    ax.legend(handles=[Patch(facecolor=colormaps[_CMAPS[k]](0.6), edgecolor="black", label=_NAMES[k]) for k in kinds]
              + [Patch(facecolor="#f4f4f4", edgecolor="#d0d0d0", label="idle (bubble)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.28 if n_stages < 4 else -0.18), ncol=len(kinds) + 1,
              fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return drawn
