"""Pipeline units and segments: the pieces of a step that the MPMD plan orders and compiles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, cast

import numpy as np
from jax.core import ShapedArray
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Var

from ..schedules import Action
from ..trace.implicit import is_backprop, microbatch_of
from ..trace.task import Placement, task_call_p
from ..trace.taskspec import loop_slices, split_names

__all__ = ["Segment", "Unit", "nbytes"]


class Unit(NamedTuple):
    """Pipeline work: microbatch ``microbatch``'s forward or backward pass through its ``run``-th stage.

    A tuple: a plan makes one per equation in a microbatch and keys them in dicts (built and hashed in C)."""

    microbatch: int
    backward: bool
    run: int


@dataclass
class Segment:
    """A run of equations on one placement, compiled as one `jax.jit`."""

    index: int
    placement: Placement
    eqns: list = field(default_factory=list)
    invars: list[Var] = field(default_factory=list)
    outvars: list[Var] = field(default_factory=list)
    unit: Unit | None = None
    action: Action | None = None
    stage: int | None = None

    @property
    def label(self) -> str:
        if self.action is not None:
            names = split_names(self.placement) if self.action.kind in ("B", "W") else None
            if names is not None:  # Task(split_backprop=(input_gradient, weight_gradient)) names the halves
                return f"{self.placement.name}/{names[self.action.kind == 'W']}:{self.action}"
            return f"{self.placement.name}:{self.action}"
        kinds = [e.params["kind"] for e in self.eqns if e.primitive is task_call_p]
        what = "+".join(dict.fromkeys(kinds)) if kinds else "glue"
        if self.unit is not None:
            what += f"[mb {self.unit.microbatch}{' bwd' if self.unit.backward else ''}]"
        elif loop_slices(self.placement) is not None:  # a task on its microbatch's slice: name the microbatch
            found = {microbatch_of(e.source_info.name_stack) for e in self.eqns} - {None}
            if len(found) == 1:
                if not kinds:  # an implicit task's equations: forward or backward by their scopes
                    what = "bwd" if any(is_backprop(e.source_info.name_stack) for e in self.eqns) else "fwd"
                what += f"[mb {found.pop()}]"
        return f"{self.placement.name}:{what}"

    def closed_jaxpr(self) -> ClosedJaxpr:
        jaxpr = Jaxpr(constvars=[], invars=list(self.invars), outvars=list(self.outvars), eqns=list(self.eqns),
                      debug_info=self._debug_info())
        return ClosedJaxpr(jaxpr, [])


    def _debug_info(self) -> DebugInfo:
        """What JAX reports a segment's jaxpr as (JAX wants one on every jaxpr): its label, its values."""
        return DebugInfo("multimesh segment", self.label, tuple(map(str, self.invars)),
                         tuple(map(str, self.outvars)))


def nbytes(v: Var) -> int:
    """The size of a jaxpr value in bytes (``dtype.itemsize``: also defined for PRNG key dtypes)."""
    aval = cast(ShapedArray, v.aval)  # a step's values are arrays; JAX types Var.aval as their base class
    return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
