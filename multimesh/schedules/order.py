"""`Schedule`: the order in which each stage runs its actions, and the global order derived from it.

A schedule is its `PipelineShape` and its per-stage orders; validation (`validate`), simulation
(`simulate`) and rendering (`render`) are functions of those, which the methods here call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from . import render as _render
from . import simulate as _simulate
from . import validate as _validate
from .actions import WEIGHT, Action, Kind, PipelineShape

__all__ = ["Schedule"]


def _has_weight_actions(actions: Iterable[object]) -> bool:
    return any(isinstance(a, Action) and a.kind == WEIGHT for a in actions)


class Schedule:
    """A pipeline schedule over ``num_stages`` device groups and ``num_microbatches``.

    Subclasses define `_build_per_stage_order`; everything else is
    derived.  Build arbitrary schedules with `from_order` or
    `from_per_stage_order`.  Instances are immutable; the list/dict
    properties return fresh copies.

    Attributes:
      name: short schedule name (``"gpipe"``, ``"1f1b"``, ``"interleaved"``...).
      shape: the `PipelineShape` it orders (stages, microbatches, chunks, forward only, split backward).
    """

    name: str = "custom"

    def __init__(self, num_stages: int, num_microbatches: int, *, num_chunks: int = 1,
                 forward_only: bool = False, split_backward: bool = False) -> None:
        self._set_shape(PipelineShape(num_stages, num_microbatches, num_chunks, forward_only, split_backward))
        self._per_stage = _validate.check_per_stage(self.shape, self._build_per_stage_order())
        self._order = self._derive_order()
        self.validate()

    def _set_shape(self, shape: PipelineShape) -> None:
        self.shape = shape
        self._cache: dict[object, _simulate.Timeline] = {}

    def _build_per_stage_order(self) -> dict[int, list[Action]]:
        raise NotImplementedError("Schedule subclasses implement _build_per_stage_order(); "
                                  "use Schedule.from_order / from_per_stage_order for explicit orders")

    def _derive_order(self) -> tuple[Action, ...]:
        """Global order: the default-cost timeline sorted by (start, stage)."""
        tl = _simulate.run(self.shape, self._per_stage, _simulate.stage_costs(self.shape, 1.0, 2.0), 0.0, self.name)
        return tuple(sorted(tl.spans, key=lambda a: (tl.spans[a][0], self.physical_stage(a), a.kind, a.stage)))

    @classmethod
    def from_order(cls, order: Iterable[Action], num_stages: int, num_microbatches: int, *, num_chunks: int = 1,
                   forward_only: bool = False, split_backward: bool | None = None, name: str = "custom") -> Schedule:
        """A schedule with an explicit global order; each stage runs its actions
        in the order they appear.  Raises ``ValueError`` if the order is invalid.

        ``split_backward=None`` (the default) infers the split from the order:
        it is a split-backward schedule iff it holds a ``W`` action (then every
        ``B`` needs its ``W``).  Pass True/False to insist: ``False`` rejects
        ``W`` actions, ``True`` requires them.
        """
        order = tuple(order)
        if split_backward is None:
            split_backward = _has_weight_actions(order)
        self = cls.__new__(Schedule)
        self._set_shape(PipelineShape(num_stages, num_microbatches, num_chunks, forward_only, split_backward))
        self.name = name
        for a in order:
            _validate.check_action(self.shape, a)
        per_stage: dict[int, list[Action]] = {s: [] for s in range(num_stages)}
        for a in order:
            per_stage[self.physical_stage(a)].append(a)
        self._per_stage = _validate.check_per_stage(self.shape, per_stage)
        self._order = order
        self.validate()
        return self

    @classmethod
    def from_per_stage_order(cls, per_stage_order: Mapping[int, Sequence[Action]], num_stages: int,
                             num_microbatches: int, *, num_chunks: int = 1, forward_only: bool = False,
                             split_backward: bool | None = None, name: str = "custom") -> Schedule:
        """A schedule from each stage's own order; the global order is derived.
        Raises ``ValueError`` if the per-stage orders are incomplete or deadlock.

        ``split_backward``: as for `from_order` (``None`` infers it from
        the presence of ``W`` actions).
        """
        if split_backward is None:
            split_backward = _has_weight_actions(a for acts in per_stage_order.values() for a in acts)
        self = cls.__new__(Schedule)
        self._set_shape(PipelineShape(num_stages, num_microbatches, num_chunks, forward_only, split_backward))
        self.name = name
        self._per_stage = _validate.check_per_stage(self.shape, per_stage_order)
        _validate.check_complete(self.shape, [a for acts in self._per_stage.values() for a in acts])
        self._order = self._derive_order()
        self.validate()
        return self

    # ------------------------------------------------------------- attributes

    @property
    def num_stages(self) -> int:
        """Physical stages (device groups), ``S``."""
        return self.shape.num_stages

    @property
    def num_microbatches(self) -> int:
        """``M``."""
        return self.shape.num_microbatches

    @property
    def num_chunks(self) -> int:
        """Virtual stages per device group, ``V`` (1 unless interleaved)."""
        return self.shape.num_chunks

    @property
    def num_logical_stages(self) -> int:
        """``S * V``."""
        return self.shape.num_logical_stages

    @property
    def forward_only(self) -> bool:
        """Only forward actions (inference)."""
        return self.shape.forward_only

    @property
    def split_backward(self) -> bool:
        """True if the backward is split into ``B`` (input gradient) and ``W``
        (weight gradient) actions; False for GPipe/1F1B/interleaved and for
        every forward-only schedule."""
        return self.shape.split_backward

    @property
    def order(self) -> list[Action]:
        """Every action once, in a valid global (topological) order."""
        return list(self._order)

    @property
    def per_stage_order(self) -> dict[int, list[Action]]:
        """Physical stage -> its actions in the order that stage runs them."""
        return {s: list(acts) for s, acts in self._per_stage.items()}

    def __iter__(self) -> Iterator[Action]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def physical_stage(self, action: Action) -> int:
        """The device group (physical stage) that runs ``action``."""
        return self.shape.physical_stage(action)

    def action(self, stage: int, microbatch: int, kind: Kind) -> Action:
        """The `Action` for logical ``stage`` (chunk filled in); ``kind``
        is ``"F"``, ``"B"`` or ``"W"``."""
        return self.shape.action(stage, microbatch, kind)

    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """The actions that must finish before ``action`` may start."""
        return self.shape.dependencies(action)

    def expected_actions(self) -> list[Action]:
        """All actions a complete schedule must contain (``W`` ones only when
        `split_backward`)."""
        return self.shape.expected_actions()

    def validate(self) -> None:
        """Check completeness and dependencies; raise ``ValueError`` if broken.

        Checks that every expected action appears exactly once, that each action
        comes after its dependencies in `order`, and that each stage's
        order is the projection of the global order onto that stage.
        """
        _validate.check_order(self.shape, self._order, self._per_stage, self.name)

    # ------------------------------------------------------------- simulation

    def simulate(self, forward_time: float = 1.0, backward_time: float = 2.0, comm_time: float = 0.0,
                 stage_times: Mapping[int, tuple[float, float]] | None = None) -> _simulate.Timeline:
        """Simulated timeline.

        ``forward_time``/``backward_time`` are the cost of a whole stage's
        forward/backward for one microbatch; each of the ``V`` chunks of an
        interleaved stage costs ``1/V`` of it.  With `split_backward`,
        ``B`` and ``W`` each cost half the backward.  ``comm_time`` is added on
        every cross-stage dependency.  ``stage_times``: ``{stage: (forward,
        backward)}`` for stages whose costs differ from the others' (an
        unbalanced pipeline).
        """
        own = tuple(sorted((stage_times or {}).items()))
        key = (forward_time, backward_time, comm_time, own)
        if key not in self._cache:
            v = self.num_chunks
            costs = _simulate.stage_costs(self.shape, forward_time / v, backward_time / v)
            costs.update({stage: _simulate.stage_costs(self.shape, f / v, b / v)[stage] for stage, (f, b) in own})
            self._cache[key] = _simulate.run(self.shape, self._per_stage, costs, comm_time, self.name)
        return self._cache[key]

    def timeline(self, forward_time: float = 1.0, backward_time: float = 2.0,
                 comm_time: float = 0.0) -> dict[Action, tuple[float, float]]:
        """Action -> ``(start, end)``; see `simulate`."""
        return dict(self.simulate(forward_time, backward_time, comm_time).spans)

    def bubble(self, forward_time: float = 1.0, backward_time: float = 2.0, comm_time: float = 0.0) -> float:
        """Bubble (idle) fraction under the given cost model."""
        return self.simulate(forward_time, backward_time, comm_time).bubble_fraction

    @property
    def bubble_fraction(self) -> float:
        """Bubble fraction with the default costs (F = 1, B = 2, no comm; split:
        F = B = W = 1)."""
        return self.bubble()

    @property
    def peak_live_activations(self) -> dict[int, int]:
        """Physical stage -> peak number of (logical stage, microbatch) pairs whose
        forward has run on it and whose backward has not finished.

        The backward finishes with ``B``, or with ``W`` in a split-backward
        schedule (``W`` still reads the stashed forward inputs, so a
        microbatch's activations stay live from its ``F`` until its ``W``).
        For interleaved schedules each pair holds one chunk's activations
        (``1/V`` of the stage's layers).  Forward-only schedules keep nothing
        for a backward pass: 0 everywhere.
        """
        return _simulate.peak_live_activations(self.shape, self._per_stage)

    # ---------------------------------------------------------------- display

    def render(self, backward_slots: int = 1, stage_names: Sequence[str] | None = None) -> str:
        """Text diagram: one row per physical stage, one column per time slot.

        Every action takes one slot (a backward ``backward_slots``; in a split
        schedule ``B`` and ``W`` each ``backward_slots``); cells show
        ``F3``/``B3``/``W3`` (``F3.1`` = chunk 1) or ``.`` when the stage is idle.
        ``stage_names``: one per physical stage, shown beside its number (a plan's stages').
        """
        return _render.render(self.shape, self._per_stage, self.name, backward_slots, stage_names)

    def __repr__(self) -> str:
        cls = type(self).__name__
        name = f"name={self.name!r}, " if cls == "Schedule" else ""
        shape = self.shape
        chunks = f", num_chunks={shape.num_chunks}" if shape.num_chunks > 1 else ""
        fo = ", forward_only=True" if shape.forward_only else ""
        split = ", split_backward=True" if shape.split_backward and type(self) is Schedule else ""
        return (f"{cls}({name}num_stages={shape.num_stages}, num_microbatches={shape.num_microbatches}"
                f"{chunks}{fo}{split}, bubble_fraction={self.bubble_fraction:.3f}, "
                f"peak_live_activations={self.peak_live_activations})")

    def __str__(self) -> str:
        return f"{self!r}\n{self.render()}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self.shape == other.shape and self._order == other._order

    def __hash__(self) -> int:
        return hash((self.shape, self._order))
