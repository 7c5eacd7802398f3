"""The units of pipeline work and the shape of a pipeline: what depends on what.

An `Action` is the forward (``"F"``), backward (``"B"``) or weight-gradient (``"W"``) pass of one
microbatch on one logical stage. A `PipelineShape` (stages, microbatches, chunks, forward-only, split
backward) says which actions a complete schedule holds and which action waits for which; it knows
nothing of any order.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["BACKWARD", "FORWARD", "WEIGHT", "Action", "Kind", "PipelineShape", "check_count"]

Kind = Literal["F", "B", "W"]
FORWARD: Kind = "F"
BACKWARD: Kind = "B"
WEIGHT: Kind = "W"


def check_count(what: str, value: object) -> int:
    """``value`` if it is a positive int, else a ValueError naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work.

    Attributes:
      stage: logical pipeline stage (``chunk * num_stages + device_group``).
      microbatch: microbatch index, ``0 <= microbatch < num_microbatches``.
      kind: ``"F"`` (forward), ``"B"`` (backward; in a split-backward schedule
        only its input-gradient pass) or ``"W"`` (weight-gradient pass, split
        schedules only).
      chunk: virtual-stage index within the device group (0 unless
        interleaved); always ``stage // num_stages``.
    """

    stage: int
    microbatch: int
    kind: Kind
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD, WEIGHT):
            raise ValueError(f"Action kind must be 'F', 'B' or 'W', got {self.kind!r}")
        for field in ("stage", "microbatch", "chunk"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"Action {field} must be a non-negative int, got {v!r}")

    @property
    def is_forward(self) -> bool:
        return self.kind == FORWARD

    @property
    def label(self) -> str:
        """Short cell label: ``F3``/``B3``/``W3`` (chunk 0) or ``F3.1`` (microbatch
        3, chunk 1)."""
        base = f"{self.kind}{self.microbatch}"
        return base if self.chunk == 0 else f"{base}.{self.chunk}"

    def __str__(self) -> str:
        extra = f",c{self.chunk}" if self.chunk else ""
        return f"{self.kind}[s{self.stage},m{self.microbatch}{extra}]"


@dataclasses.dataclass(frozen=True)
class PipelineShape:
    """The pipeline a schedule orders: ``num_stages`` device groups (``S``), ``num_microbatches``
    (``M``), ``num_chunks`` virtual stages per group (``V``), forward only or not, the backward split
    into ``B`` and ``W`` or not (never when forward only: nothing to split)."""

    num_stages: int
    num_microbatches: int
    num_chunks: int = 1
    forward_only: bool = False
    split_backward: bool = False

    def __post_init__(self) -> None:
        check_count("num_stages", self.num_stages)
        check_count("num_microbatches", self.num_microbatches)
        check_count("num_chunks", self.num_chunks)
        object.__setattr__(self, "forward_only", bool(self.forward_only))
        object.__setattr__(self, "split_backward", bool(self.split_backward) and not self.forward_only)

    @property
    def num_logical_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def physical_stage(self, action: Action) -> int:
        """The device group (physical stage) that runs ``action``."""
        return action.stage % self.num_stages

    def action(self, stage: int, microbatch: int, kind: Kind) -> Action:
        """The `Action` for logical ``stage`` (chunk filled in)."""
        return Action(stage, microbatch, kind, stage // self.num_stages)

    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """The actions that must finish before ``action`` may start."""
        l, m = action.stage, action.microbatch
        if action.kind == FORWARD:
            return (self.action(l - 1, m, FORWARD),) if l > 0 else ()
        if action.kind == WEIGHT:
            return (self.action(l, m, BACKWARD),)
        deps = [self.action(l, m, FORWARD)]
        if l < self.num_logical_stages - 1:
            deps.append(self.action(l + 1, m, BACKWARD))
        return tuple(deps)

    def expected_actions(self) -> list[Action]:
        """All actions a complete schedule must contain (``W`` ones only with a split backward)."""
        kinds: tuple[Kind, ...] = (FORWARD,) if self.forward_only else (FORWARD, BACKWARD)
        if self.split_backward:
            kinds += (WEIGHT,)
        return [self.action(l, m, k) for k in kinds for l in range(self.num_logical_stages)
                for m in range(self.num_microbatches)]
