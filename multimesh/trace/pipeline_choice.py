"""A pipeline chosen from outside the step: how many microbatches, which schedule, how many stages.

A step asks for a pipeline where it calls `microbatch(loss, dim, size, schedule=...)`.
A layout search (`multimesh.autolayout`) tries other microbatch counts and
schedules without rewriting the step: inside ``with choose_pipeline(...)`` every
`microbatch` call traced splits its batch into the chosen number of microbatches
and runs the chosen schedule, whatever its own arguments say.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PipelineChoice", "choose_pipeline", "chosen_pipeline"]


@dataclass(frozen=True)
class PipelineChoice:
    """``microbatches`` per step, ``schedule`` (a name `get_schedule` knows), ``stages``, and ``interleave``
    (virtual stages per device group of the interleaved schedule; None for the others)."""

    microbatches: int
    schedule: str
    stages: int
    interleave: int | None = None

    def size_for(self, where: str, leaves: Sequence[Any], dim: int) -> int:
        """The microbatch size along ``dim`` that gives ``microbatches`` microbatches of ``leaves``."""
        length = np.shape(leaves[0])[dim]
        if length % self.microbatches:
            raise ValueError(f"{where}: the pipeline chosen for this layout splits dimension {dim} (size {length}) "
                             f"into {self.microbatches} microbatches, which does not divide it; choose a number "
                             f"of microbatches that divides {length}")
        return length // self.microbatches


_CHOICE: contextvars.ContextVar[PipelineChoice | None] = contextvars.ContextVar("multimesh_pipeline_choice",
                                                                                 default=None)


def chosen_pipeline() -> PipelineChoice | None:
    """The choice in force (None: each `microbatch` call keeps its own arguments)."""
    return _CHOICE.get()


@contextlib.contextmanager
def choose_pipeline(microbatches: int, schedule: str, stages: int,
                    interleave: int | None = None) -> Iterator[PipelineChoice]:
    """Within the block, `microbatch` calls traced use this many microbatches, schedule and stages."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"choose_pipeline: microbatches must be a positive int, got {microbatches!r}")
    choice = PipelineChoice(microbatches, schedule, stages, interleave)
    token = _CHOICE.set(choice)
    try:
        yield choice
    finally:
        _CHOICE.reset(token)
